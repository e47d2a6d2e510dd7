// A rank that fails, or never joins, ends the whole mpirun job, non-zero, with a message, in
// bounded time.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <regex>
#include <string>

namespace {

struct JobResult {
  int exit_code = -1;
  std::string output;
  double seconds = 0;
};

// Runs `np` ranks of a job under mpirun, killed after 60 s (exit code 124) if still running.
JobResult run_job(const std::string& job, int np, const std::string& args = "") {
  std::string command = std::string("timeout -k 5 60 ") + SHARDTRAIN_MPIEXEC +
                        " --oversubscribe -np " + std::to_string(np) + " " +
                        SHARDTRAIN_MPI_JOB_DIR + "/mpi_job_" + job + " " + args + " 2>&1";
  JobResult r;
  auto start = std::chrono::steady_clock::now();
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return r;
  std::array<char, 4096> buf{};
  size_t got = 0;
  while ((got = fread(buf.data(), 1, buf.size(), pipe)) > 0) r.output.append(buf.data(), got);
  int status = pclose(pipe);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

class RankFailure : public ::testing::TestWithParam<int> {};

TEST_P(RankFailure, EndsTheJobNonZeroWithTheRanksMessage) {
  const int np = GetParam();
  JobResult r = run_job("failing_rank", np);
  const std::string expected =
      "rank " + std::to_string(np - 1) + ": simulated failure in step 1 (layer 1 forward)";
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.exit_code, 124) << "the job hung until the launcher's timeout killed it\n"
                              << r.output;
  EXPECT_NE(r.output.find(expected), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 30.0) << r.output;
  // Step 0 completed everywhere before the failure.
  for (int rank = 0; rank < np; ++rank)
    EXPECT_NE(r.output.find("rank " + std::to_string(rank) + " finished step 0"), std::string::npos)
        << r.output;
  EXPECT_EQ(r.output.find("finished step 1"), std::string::npos) << r.output;
}

// A rank that does not join the job at all: the others give up after dist.timeout_s instead of
// waiting in MPI's start-up or the communicator set-up, which have no limit of their own.
// In MPI's own start-up (the others wait for the late rank there) and, with MPI started
// everywhere, in the communicator set-up (the watchdog then ends the job with MPI_Abort).
TEST_P(RankFailure, ARankThatNeverJoinsEndsTheJobAfterTheTimeout) {
  const int np = GetParam();
  for (const std::string args : {"", "after-init"}) {
    SCOPED_TRACE(args.empty() ? "late before MPI starts" : "late after MPI started");
    JobResult r = run_job("late_rank", np, args);
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_NE(r.exit_code, 124) << "the job hung until the launcher's timeout killed it\n"
                                << r.output;
    // Every waiting rank gives up after 3 s, and the first to exit ends the job, perhaps
    // before the others print (with 4 ranks on 2 cores, rank 0 may well be among those): one
    // of them says so, and never the late rank, which is still asleep.
    std::smatch said;
    ASSERT_TRUE(std::regex_search(
        r.output, said, std::regex(R"(rank (\d+): the job's start-up did not finish within 3 s)")))
        << r.output;
    EXPECT_LT(std::stoi(said[1].str()), np - 1) << r.output;
    EXPECT_NE(r.output.find("dist.timeout_s sets this limit"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("joined the job"), std::string::npos) << r.output;
    EXPECT_LT(r.seconds, 30.0) << r.output;
  }
}

// A command line that only one rank has wrong (a wrapper script adding flags to some ranks): that
// rank says what is wrong itself, since rank 0, which speaks for a job's usage errors, has none.
TEST(RankFailureCommandLine, AUsageErrorOnOneRankIsPrintedByThatRank) {
  const std::string binary = SHARDTRAIN_BINARY;
  const std::string config = std::string(SHARDTRAIN_SOURCE_DIR) + "/configs/tiny.yaml";
  const std::string script = "if [ \"$OMPI_COMM_WORLD_RANK\" = 1 ]; then exec " + binary +
                             " config --config " + config + " --no-such-flag; else exec " + binary +
                             " config --config " + config + " >/dev/null; fi";
  std::string command = std::string("timeout -k 5 60 ") + SHARDTRAIN_MPIEXEC +
                        " --oversubscribe -np 2 sh -c '" + script + "' 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  std::array<char, 4096> buf{};
  size_t got = 0;
  while ((got = fread(buf.data(), 1, buf.size(), pipe)) > 0) output.append(buf.data(), got);
  const int status = pclose(pipe);
  ASSERT_TRUE(WIFEXITED(status)) << output;
  EXPECT_NE(WEXITSTATUS(status), 0) << output;
  EXPECT_NE(WEXITSTATUS(status), 124) << output;
  EXPECT_NE(output.find("rank 1: error: unknown flag '--no-such-flag' for 'shardtrain config'"),
            std::string::npos)
      << output;
}

INSTANTIATE_TEST_SUITE_P(Ranks, RankFailure, ::testing::Values(2, 4),
                         [](const auto& info) { return "np" + std::to_string(info.param); });

}  // namespace
