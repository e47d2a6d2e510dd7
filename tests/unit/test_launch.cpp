// What a process learns of its launch from the launcher's environment, before MPI starts: its
// rank, the world size and how many ranks share its node (which picks its GPU, sizes the node's
// host-memory check and shares the node's CPUs among the ranks).
#include <gtest/gtest.h>
#include <stdlib.h>

#include <map>
#include <optional>
#include <string>

#include <omp.h>

#include "shardtrain/backend/cpu_threads.h"
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

TEST(FairCpuThreads, SharesTheNodeAndStaysWithinTheAffinityMask) {
  EXPECT_EQ(fair_cpu_threads(64, 64, 8), 8);
  EXPECT_EQ(fair_cpu_threads(64, 64, 1), 64);
  EXPECT_EQ(fair_cpu_threads(2, 2, 4), 1);    // more ranks than CPUs: one thread each
  EXPECT_EQ(fair_cpu_threads(32, 64, 8), 8);  // bound to a socket that 4 of the 8 share
  EXPECT_EQ(fair_cpu_threads(4, 64, 2), 4);   // bound to 4 cores: never more than those
  EXPECT_EQ(fair_cpu_threads(0, 0, 0), 1);
}

// OpenMP's thread count for one test, put back afterwards, with OMP_NUM_THREADS as given.
class ScopedOpenMpThreads {
 public:
  ScopedOpenMpThreads(int threads, const char* env) : before_(omp_get_max_threads()) {
    const char* old = std::getenv("OMP_NUM_THREADS");
    if (old) saved_env_ = old;
    if (env)
      setenv("OMP_NUM_THREADS", env, 1);
    else
      unsetenv("OMP_NUM_THREADS");
    omp_set_num_threads(threads);
  }
  ~ScopedOpenMpThreads() {
    if (saved_env_)
      setenv("OMP_NUM_THREADS", saved_env_->c_str(), 1);
    else
      unsetenv("OMP_NUM_THREADS");
    omp_set_num_threads(before_);
  }

 private:
  int before_;
  std::optional<std::string> saved_env_;
};

TEST(ShareCpuThreads, RanksOnOneNodeTakeTheirShareWhenOpenMpIsNotTold) {
  // A default of far more threads than any one of 1000 ranks' share of this machine's CPUs.
  ScopedOpenMpThreads scoped(4096, nullptr);
  const CpuThreadShare share = share_cpu_threads(1000);
  EXPECT_FALSE(share.from_environment);
  EXPECT_TRUE(share.changed);
  const int expected = fair_cpu_threads(share.usable_cpus, share.node_cpus, 1000);
  EXPECT_EQ(share.threads, expected);
  EXPECT_EQ(omp_get_max_threads(), expected);
  EXPECT_EQ(cpu_thread_count(), expected);
}

TEST(ShareCpuThreads, OmpNumThreadsAndOneRankAreLeftAlone) {
  {
    ScopedOpenMpThreads scoped(4096, "4096");
    const CpuThreadShare share = share_cpu_threads(1000);
    EXPECT_TRUE(share.from_environment);
    EXPECT_FALSE(share.changed);
    EXPECT_EQ(omp_get_max_threads(), 4096);
  }
  {
    ScopedOpenMpThreads scoped(4096, nullptr);
    EXPECT_FALSE(share_cpu_threads(1).changed);
    EXPECT_EQ(omp_get_max_threads(), 4096);
  }
  {
    // Never raised: a process already told to use fewer threads keeps them.
    ScopedOpenMpThreads scoped(1, nullptr);
    EXPECT_FALSE(share_cpu_threads(2).changed);
    EXPECT_EQ(omp_get_max_threads(), 1);
  }
}

}  // namespace
}  // namespace shardtrain::dist
