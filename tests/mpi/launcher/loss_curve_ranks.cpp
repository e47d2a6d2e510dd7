// 100 steps of configs/tiny.yaml with the same global batch at 1, 2 and 4 ranks give the same
// loss curve: sharding changes where the arithmetic happens, not what is learned.
//
// Two tolerances, because fp32 training is chaotic. Sharding sums the gradients in another
// order, so the curves start apart by rounding alone: over the first 15 steps they agree to
// 1e-6 (a few ulps of a loss near 5; measured: 2.4e-7), which any real sharding error, a
// missing or twice-counted gradient piece, would exceed by orders of magnitude. Later, a loss
// spike amplifies those differences (measured: 6e-6 by step 20, 1.3e-4 by step 100 at 4
// ranks), so the whole curve is held to 1e-3, a hundredth of the loss's own step-to-step change.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace {

std::vector<double> train_losses(int np, const std::string& extra) {
  std::string out = (std::filesystem::temp_directory_path() /
                     ("shardtrain-ranks-" + std::to_string(::getpid()) + "-" + std::to_string(np)))
                        .string();
  // The global batch is 16 sequences whatever the number of ranks.
  std::string command = std::string("timeout -k 5 900 ") + SHARDTRAIN_MPIEXEC +
                        " --oversubscribe -np " + std::to_string(np) + " " + SHARDTRAIN_BINARY +
                        " train --config " + SHARDTRAIN_SOURCE_DIR + "/configs/tiny.yaml" +
                        " --set train.device=cpu --set train.steps=100 --set train.eval_every=0" +
                        " --set train.export=false --set train.progress=none" +
                        " --set checkpoint.every_steps=0 --set train.global_batch=16" +
                        " --set train.micro_batch=" + std::to_string(16 / np) +
                        " --set train.out_dir=" + out + " " + extra + " > " + out + ".log 2>&1";
  int status = std::system(command.c_str());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "np " << np << ": " << command;
  std::vector<double> losses;
  std::ifstream in(out + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    if (line.find("\"event\":\"step\"") == std::string::npos) continue;
    size_t at = line.find("\"loss\":");
    if (at != std::string::npos) losses.push_back(std::stod(line.substr(at + 7)));
  }
  std::filesystem::remove_all(out);
  std::filesystem::remove(out + ".log");
  return losses;
}

TEST(LossCurveAcrossRanks, OneTwoAndFourRanksTrainTheSame) {
  std::vector<double> one = train_losses(1, "");
  ASSERT_EQ(one.size(), 100u);
  EXPECT_LT(one.back(), one.front() - 1.0) << "the run did not learn";
  for (int np : {2, 4}) {
    std::vector<double> curve = train_losses(np, "--set dist.sharding=full_shard");
    ASSERT_EQ(curve.size(), one.size()) << "np " << np;
    constexpr size_t kEarlySteps = 15;
    double worst = 0, worst_early = 0;
    for (size_t i = 0; i < one.size(); ++i) {
      const double gap = std::fabs(curve[i] - one[i]);
      worst = std::max(worst, gap);
      if (i < kEarlySteps) worst_early = std::max(worst_early, gap);
    }
    EXPECT_LT(worst_early, 1e-6) << "np " << np << ", first " << kEarlySteps << " steps";
    EXPECT_LT(worst, 1e-3) << "np " << np;
    std::printf(
        "np %d: max |loss - 1-rank loss| over the first %zu steps = %.3e, over 100 = %.3e\n", np,
        kEarlySteps, worst_early, worst);
  }
}

}  // namespace
