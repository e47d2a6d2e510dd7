// What a process learns of its launch from the launcher's environment, before MPI starts: its
// rank, the world size and how many ranks share its node (which picks its GPU and sizes the
// node's host-memory check).
#include <gtest/gtest.h>
#include <stdlib.h>

#include <map>
#include <optional>
#include <string>

#include "shardtrain/dist/env.h"

namespace shardtrain::dist {
namespace {

TEST(SlurmTasksOnNode, ReadsTheEntryOfTheNode) {
  EXPECT_EQ(slurm_tasks_on_node("4", 0), 4);
  EXPECT_EQ(slurm_tasks_on_node("3,2", 0), 3);
  EXPECT_EQ(slurm_tasks_on_node("3,2", 1), 2);
  for (int node : {0, 1, 2}) EXPECT_EQ(slurm_tasks_on_node("2(x3),1", node), 2) << node;
  EXPECT_EQ(slurm_tasks_on_node("2(x3),1", 3), 1);
  EXPECT_EQ(slurm_tasks_on_node("1,4(x2)", 2), 4);
}

TEST(SlurmTasksOnNode, MalformedOrShortListsGiveNothing) {
  for (const char* bad : {"", "x", "2(x)", "2(x0)", "2(3)", "2(x3", "0", "-1", "2(x3)4"})
    EXPECT_FALSE(slurm_tasks_on_node(bad, 0).has_value()) << bad;
  EXPECT_FALSE(slurm_tasks_on_node("3,,2", 1).has_value());
  EXPECT_FALSE(slurm_tasks_on_node("3,2", 2).has_value());
  EXPECT_FALSE(slurm_tasks_on_node("2(x3)", 3).has_value());
  EXPECT_FALSE(slurm_tasks_on_node("3", -1).has_value());
}

// Sets environment variables for one test and restores what was there before.
class ScopedEnv {
 public:
  explicit ScopedEnv(const std::map<std::string, std::string>& values) {
    for (const auto& [name, value] : values) {
      const char* old = std::getenv(name.c_str());
      saved_[name] = old ? std::optional<std::string>(old) : std::nullopt;
      setenv(name.c_str(), value.c_str(), 1);
    }
  }
  ~ScopedEnv() {
    for (const auto& [name, old] : saved_) {
      if (old)
        setenv(name.c_str(), old->c_str(), 1);
      else
        unsetenv(name.c_str());
    }
  }

 private:
  std::map<std::string, std::optional<std::string>> saved_;
};

TEST(DetectLaunch, SlurmTasksOnASmallerNode) {
  if (std::getenv("OMPI_COMM_WORLD_RANK") || std::getenv("PMI_RANK"))
    GTEST_SKIP() << "started by another launcher, whose variables take precedence";
  // Five tasks on two nodes, three on the first: the second node's two.
  ScopedEnv env({{"SLURM_PROCID", "4"},
                 {"SLURM_STEP_NUM_TASKS", "5"},
                 {"SLURM_LOCALID", "1"},
                 {"SLURM_NODEID", "1"},
                 {"SLURM_STEP_TASKS_PER_NODE", "3,2"}});
  const LaunchInfo info = detect_launch();
  EXPECT_EQ(info.launcher, "slurm");
  EXPECT_EQ(info.rank, 4);
  EXPECT_EQ(info.world_size, 5);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_size, 2);
}

}  // namespace
}  // namespace shardtrain::dist
