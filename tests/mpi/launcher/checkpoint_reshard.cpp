// Checkpoints across job shapes, through the real CLI: a checkpoint written by 4 ranks resumes on
// 2 ranks and on 1 process, and under other sharding strategies, continuing the 4-rank loss curve
// within 1e-6; SIGUSR1 sent to mpirun (which forwards it) stops every rank with a checkpoint and
// exit code 0, and the job resumed from it on 4 ranks continues the curve of one never stopped.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "temp_dir.h"
#include "tiny_run.h"

namespace fs = std::filesystem;

namespace {

using shardtrain::testing::read_file_bytes;
using shardtrain::testing::read_step_losses;

// A temporary directory holding the shared tiny run's config.yaml.
struct TempDir : shardtrain::testing::TempDir {
  TempDir() : shardtrain::testing::TempDir("reshard") {
    write("config.yaml", shardtrain::testing::kTinyRunYaml);
  }
};

// What these jobs change in the shared run: progress lines (the signal test waits for one) and a
// checkpoint every 10 steps, all kept.
const std::vector<std::string> kRunSets = {"train.progress=lines", "train.log_every=10",
                                           "checkpoint.every_steps=10", "checkpoint.keep_last=0"};

// `shardtrain train` on `np` ranks under mpirun (np 0: a plain process), killed after 240 s
// unless `signals` (timeout(1) would not pass SIGUSR1 on to mpirun).
std::vector<std::string> train_command(const TempDir& tmp, int np, const std::string& out_dir,
                                       const std::vector<std::string>& sets, bool signals = false) {
  std::vector<std::string> argv;
  if (!signals) argv = {"timeout", "-k", "5", "240"};
  if (np > 0)
    argv.insert(argv.end(), {SHARDTRAIN_MPIEXEC, "--oversubscribe", "-np", std::to_string(np)});
  argv.insert(argv.end(), {SHARDTRAIN_BINARY, "train", "--config", tmp / "config.yaml", "--set",
                           "train.out_dir=" + out_dir});
  for (const std::string& s : kRunSets) argv.insert(argv.end(), {"--set", s});
  for (const std::string& s : sets) argv.insert(argv.end(), {"--set", s});
  return argv;
}

// Starts `argv` with stdout and stderr going to `log`; returns its pid.
pid_t start(const std::vector<std::string>& argv, const std::string& log) {
  std::vector<std::string> args = argv;
  std::vector<char*> c_args;
  for (auto& a : args) c_args.push_back(a.data());
  c_args.push_back(nullptr);
  pid_t pid = fork();
  if (pid == 0) {
    int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
    }
    execvp(c_args[0], c_args.data());
    _exit(127);
  }
  return pid;
}

int wait_for(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

struct JobRun {
  int exit_code = -1;
  std::string output;
  std::map<int64_t, double> losses;  // step -> loss from metrics.jsonl
};

JobRun train(const TempDir& tmp, int np, const std::string& name,
             const std::vector<std::string>& sets) {
  const std::string out_dir = tmp / name;
  JobRun r;
  r.exit_code = wait_for(start(train_command(tmp, np, out_dir, sets), tmp / (name + ".log")));
  r.output = read_file_bytes(tmp / (name + ".log"));
  r.losses = read_step_losses(out_dir + "/metrics.jsonl");
  return r;
}

void expect_continues(const JobRun& run, const JobRun& ref, int64_t first,
                      const std::string& what) {
  ASSERT_EQ(run.exit_code, 0) << what << "\n" << run.output;
  ASSERT_EQ(run.losses.size(), static_cast<size_t>(41 - first)) << what << "\n" << run.output;
  for (const auto& [step, loss] : run.losses) {
    EXPECT_GE(step, first) << what;
    EXPECT_NEAR(loss, ref.losses.at(step), 1e-6) << what << ", step " << step;
  }
}

std::vector<std::string> rank_files(const std::string& dir, int step) {
  std::vector<std::string> out;
  char prefix[32];
  std::snprintf(prefix, sizeof prefix, "step-%08d.rank-", step);
  for (const auto& e : fs::directory_iterator(dir)) {
    std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) == 0) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string ckpt(const TempDir& tmp, const std::string& run, int step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%08d.h5", step);
  return tmp / (run + "/checkpoints/" + name);
}

TEST(CheckpointReshard, FourRanksResumeOnTwoAndOneAndUnderEveryOtherSharding) {
  TempDir tmp;
  JobRun a = train(tmp, 4, "a", {"dist.sharding=full_shard"});
  ASSERT_EQ(a.exit_code, 0) << a.output;
  ASSERT_EQ(a.losses.size(), 40u) << a.output;
  EXPECT_EQ(rank_files(tmp / "a/checkpoints", 20).size(), 4u);

  // 4 ranks (full_shard) -> 2 ranks (no_shard), which write one rank file: replicas write none.
  JobRun b = train(tmp, 2, "b", {"dist.sharding=no_shard", "train.resume=" + ckpt(tmp, "a", 20)});
  expect_continues(b, a, 21, "4 -> 2 ranks");
  EXPECT_EQ(rank_files(tmp / "b/checkpoints", 30),
            std::vector<std::string>{"step-00000030.rank-0.h5"});
  // 2 ranks -> 1 process.
  JobRun c = train(tmp, 0, "c", {"train.resume=" + ckpt(tmp, "b", 30)});
  expect_continues(c, a, 31, "2 ranks -> 1 process");
  // 4 ranks -> 4 ranks as two pretend nodes (hybrid_shard): node 0's ranks write.
  JobRun d = train(tmp, 4, "d",
                   {"dist.sharding=hybrid_shard", "dist.ranks_per_node=2",
                    "train.resume=" + ckpt(tmp, "a", 10)});
  expect_continues(d, a, 11, "full_shard -> hybrid_shard");
  EXPECT_EQ(rank_files(tmp / "d/checkpoints", 20),
            (std::vector<std::string>{"step-00000020.rank-0.h5", "step-00000020.rank-1.h5"}));
  // hybrid on 4 -> grad_op_shard on 2.
  JobRun e =
      train(tmp, 2, "e", {"dist.sharding=grad_op_shard", "train.resume=" + ckpt(tmp, "d", 30)});
  expect_continues(e, a, 31, "hybrid_shard on 4 -> grad_op_shard on 2");

  // h5ls sees each tensor of a 4-rank checkpoint at full shape.
  int code = std::system("command -v h5ls >/dev/null 2>&1");
  if (code != 0) GTEST_SKIP() << "hdf5-tools not installed";
  const std::string listing_path = tmp / "h5ls.txt";
  ASSERT_EQ(std::system(("h5ls -r " + ckpt(tmp, "a", 20) + " > " + listing_path).c_str()), 0);
  std::string listing = read_file_bytes(listing_path);
  for (const char* line : {"/model/model.embed_tokens.weight Dataset {256, 32}",
                           "/optim/exp_avg_sq/model.layers.1.mlp.down_proj.weight Dataset {32, 64}",
                           "/model/model.norm.weight Dataset {32}"})
    EXPECT_NE(listing.find(line), std::string::npos) << line << "\n" << listing;
}

// The stopped job's length is not known in advance: at a constant rate after the warm-up, its
// steps are those of a job of any length.
constexpr const char* kConstantRate = "optim.schedule=constant";

TEST(CheckpointSignals, Sigusr1ToMpirunStopsEveryRankWithACheckpoint) {
  TempDir tmp;
  const std::string log = tmp / "stopped.log";
  pid_t job = start(train_command(tmp, 2, tmp / "run",
                                  {"train.steps=100000", "checkpoint.every_steps=0", kConstantRate},
                                  /*signals=*/true),
                    log);
  // A few steps in: the metrics record (flushed a step at a time) has step 3.
  const std::string metrics = tmp / "run/metrics.jsonl";
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (read_file_bytes(metrics).find("\"step\":3,") == std::string::npos &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  kill(job, SIGUSR1);
  // Our own time limit: the job is not under timeout(1).
  std::thread watchdog([job] {
    for (int i = 0; i < 1200; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      if (kill(job, 0) != 0) return;
    }
    kill(job, SIGKILL);
  });
  const int code = wait_for(job);
  watchdog.join();
  const std::string output = read_file_bytes(log);
  ASSERT_EQ(code, 0) << output;
  std::smatch m;
  ASSERT_TRUE(
      std::regex_search(output, m, std::regex(R"(received SIGUSR1: stopped after step (\d+))")))
      << output;
  const int stopped = std::stoi(m[1].str());
  EXPECT_GE(stopped, 3) << "the signal came after step 3";
  EXPECT_EQ(rank_files(tmp / "run/checkpoints", stopped).size(), 2u);

  // Another job shape picks it up.
  const std::string steps = "train.steps=" + std::to_string(stopped + 3);
  JobRun resumed =
      train(tmp, 4, "run", {steps, "train.resume=auto", "checkpoint.every_steps=0", kConstantRate});
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from " + ckpt(tmp, "run", stopped)), std::string::npos)
      << resumed.output;
  // The metrics file goes on: the stopped run's steps, then the three new ones, on the curve of
  // a job that was never stopped (world sizes agree within 1e-6, as above).
  JobRun reference = train(tmp, 2, "reference", {steps, kConstantRate});
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  ASSERT_EQ(resumed.losses.size(), static_cast<size_t>(stopped + 3));
  ASSERT_EQ(reference.losses.size(), resumed.losses.size());
  for (const auto& [step, loss] : resumed.losses)
    EXPECT_NEAR(loss, reference.losses.at(step), 1e-6) << "step " << step;
}

}  // namespace

namespace {

// A run every rank refuses at start (here LoRA, which trains on one rank) ends the job non-zero
// with that reason and leaves no directory behind: it is refused before any rank creates one, so
// no rank works in a directory another takes back. (Which rank gets there first is a race: four
// jobs.)
TEST(CheckpointDirectories, ARunRefusedOnEveryRankLeavesNoDirectories) {
  TempDir tmp;
  for (int attempt = 0; attempt < 4; ++attempt) {
    const std::string name = "refused" + std::to_string(attempt);
    JobRun refused = train(tmp, 2, name, {"lora.enabled=true"});
    EXPECT_NE(refused.exit_code, 0) << refused.output;
    EXPECT_NE(refused.output.find("lora.enabled trains on one rank"), std::string::npos)
        << refused.output;
    EXPECT_FALSE(fs::exists(tmp / name)) << refused.output;
  }
}

}  // namespace
