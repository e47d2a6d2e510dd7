// 100 steps of configs/tiny.yaml with the same global batch at 1, 2 and 4 ranks give the same
// loss curve (within 1e-4): sharding changes where the arithmetic happens, not what is learned.
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
    double worst = 0;
    for (size_t i = 0; i < one.size(); ++i) worst = std::max(worst, std::fabs(curve[i] - one[i]));
    EXPECT_LT(worst, 1e-4) << "np " << np;
    std::printf("np %d: max |loss - 1-rank loss| over 100 steps = %.3e\n", np, worst);
  }
}

}  // namespace
