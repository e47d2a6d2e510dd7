// Start-up of a job under mpirun: ranks started with different settings stop together at once,
// each naming the keys that differ, instead of exchanging messages of different sizes later.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

#include "shardtrain/dist/env.h"
#include "shardtrain/io/hf_model.h"
#include "shardtrain/train/bench.h"
#include "shardtrain/train/check.h"
#include "shardtrain/train/runtime.h"
#include "shardtrain/train/trainer.h"
#include "tiny_run.h"

using namespace shardtrain;

namespace {

// A fresh directory of this rank's own, named after the job (mpirun's pid) and the rank.
std::filesystem::path rank_directory(const std::string& what) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("shardtrain-" + what + "-" + std::to_string(::getppid()) +
                                     "-" + std::to_string(dist::job_rank()));
  std::filesystem::create_directories(dir);
  return dir;
}

TEST(StartUp, RanksWithDifferentConfigsStopNamingTheKeys) {
  const int rank = dist::job_rank();
  // The last rank alone trains a different number of steps with a different micro-batch.
  const bool odd_one = rank == dist::job_world_size() - 1;
  std::vector<std::string> overrides = {"train.steps=5"};
  if (odd_one) overrides = {"train.steps=6", "train.micro_batch=4"};
  train::Config config =
      train::Config::parse(shardtrain::testing::kTinyRunYaml, overrides, "start-up test");
  try {
    train::Runtime rt(config);
    ADD_FAILURE() << "rank " << rank << " started although the ranks' configs differ";
  } catch (const ConfigError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("different configurations"), std::string::npos) << message;
    EXPECT_NE(message.find("train.micro_batch"), std::string::npos) << message;
    EXPECT_NE(message.find("train.steps"), std::string::npos) << message;
    EXPECT_EQ(message.find("train.seq_len"), std::string::npos) << message;
  }
}

TEST(StartUp, RanksWithTheSameConfigStart) {
  train::Config config =
      train::Config::parse(shardtrain::testing::kTinyRunYaml, {}, "start-up test");
  train::Runtime rt(config);
  EXPECT_EQ(rt.dist().world_size(), dist::job_world_size());
}

// QLoRA runs on one rank: a LoRA run under mpirun says so at start, on every rank, whatever the
// sharding (no_shard too), rather than failing inside the sharding with a message about fp32.
TEST(StartUp, LoraUnderSeveralRanksIsRefusedAtStart) {
  if (dist::job_world_size() < 2) GTEST_SKIP() << "needs several ranks";
  for (const char* sharding : {"full_shard", "no_shard"}) {
    train::Config config = train::Config::parse(
        shardtrain::testing::kTinyRunYaml,
        {"lora.enabled=true", "lora.quantize_base=none", std::string("dist.sharding=") + sharding},
        "start-up test");
    try {
      train::Runtime rt(config);
      ADD_FAILURE() << "a LoRA run started on " << dist::job_world_size() << " ranks";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("lora.enabled trains on one rank (single-GPU QLoRA), "
                                           "but this job has " +
                                           std::to_string(dist::job_world_size()) + " ranks"),
                std::string::npos)
          << sharding << ": " << e.what();
    }
  }
}

// One data.path that names different files on different ranks (node-local copies that differ):
// every rank stops at start, instead of training on different data.
TEST(StartUp, RanksReadingDifferentDataStop) {
  if (dist::job_world_size() < 2) GTEST_SKIP() << "needs several ranks";
  const int rank = dist::job_rank();
  const std::filesystem::path original = std::filesystem::current_path();
  const std::filesystem::path here = rank_directory("data");
  {
    std::string text;
    for (int i = 0; i < 400; ++i)
      text += "the same words on every rank, line " + std::to_string(i) + "\n";
    if (rank == dist::job_world_size() - 1) text[1000] = '#';  // one byte differs
    std::ofstream(here / "corpus.txt") << text;
  }
  // Made on every rank beforehand, so that no rank waits for rank 0 to create them.
  std::filesystem::create_directories(here / "run/checkpoints");
  std::filesystem::current_path(here);
  train::Config config = train::Config::parse(
      shardtrain::testing::kTinyRunYaml,
      {"data.path=corpus.txt", "train.steps=1", "train.out_dir=run"},  // the same text everywhere
      "start-up test");
  try {
    train::run_training(config);
    ADD_FAILURE() << "rank " << rank << " trained although the ranks' data differ";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("holds different tokens on different ranks"),
              std::string::npos)
        << e.what();
  }
  std::filesystem::current_path(original);
  std::filesystem::remove_all(here);
}

// A checkpoint directory that is a different directory on each rank (node-local storage, a
// relative path from different working directories): every rank stops at start, naming the
// first rank that does not see rank 0's file, instead of failing the first save.
TEST(StartUp, ACheckpointDirectoryTheRanksDoNotShareStopsAtStart) {
  if (dist::job_world_size() < 2) GTEST_SKIP() << "needs several ranks";
  const int rank = dist::job_rank();
  const std::filesystem::path original = std::filesystem::current_path();
  const std::filesystem::path here = rank_directory("checkpoints");
  // Made on every rank beforehand, so that no rank waits for rank 0 to create them.
  std::filesystem::create_directories(here / "run/checkpoints");
  std::filesystem::current_path(here);
  train::Config config = train::Config::parse(
      shardtrain::testing::kTinyRunYaml, {"train.steps=1", "train.out_dir=run"}, "start-up test");
  try {
    train::run_training(config);
    ADD_FAILURE() << "rank " << rank << " trained although the ranks' directories differ";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("'run/checkpoints' is not the same directory on every "
                                         "rank: rank 1 does not see the file rank 0 made in it"),
              std::string::npos)
        << e.what();
  }
  std::filesystem::current_path(original);
  std::filesystem::remove_all(here);
}

// check under mpirun: a rank given other tolerances would reach its own verdict while rank 0
// prints another; every rank stops at start, naming the flag.
TEST(StartUp, CheckRanksWithDifferentTolerancesStop) {
  if (dist::job_world_size() < 2) GTEST_SKIP() << "needs several ranks";
  const std::string golden = std::string(SHARDTRAIN_TEST_DATA) + "/golden/llama-tiny-gqa";
  train::CheckOptions options;
  options.model_dir = golden;
  options.batch_file = golden + "/batch.safetensors";
  options.expected_file = golden + "/expected.safetensors";
  options.rtol = dist::job_rank() == dist::job_world_size() - 1 ? 1e-9 : 1e-4;
  try {
    train::run_check(train::Config::parse("{}", {"train.device=cpu"}, "check"), options);
    ADD_FAILURE() << "rank " << dist::job_rank() << " checked with other tolerances";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("check: the ranks were given different --rtol"),
              std::string::npos)
        << e.what();
  }
}

// Weights with a NaN, loaded into shards: the rank whose shard holds it and the ranks whose
// shards do not all stop at start, with the tensor named where it was found.
TEST(StartUp, NonFiniteHfWeightsStopEveryRank) {
  const int rank = dist::job_rank();
  const std::filesystem::path original = std::filesystem::current_path();
  const std::filesystem::path here = rank_directory("hf");
  train::Config config =
      train::Config::parse(shardtrain::testing::kTinyRunYaml,
                           {"train.steps=1", "dist.sharding=full_shard"}, "start-up test");
  {
    nn::LlamaModel model(train::llama_config_from(config.model), Device::cpu());
    model.init_weights(3);
    for (auto& [name, slot] : model.named_parameters())
      if (name == "model.norm.weight") slot->data<float>()[1] = std::nanf("");
    io::save_hf_model(model, (here / "model").string());
  }
  std::filesystem::current_path(here);
  config.model.from_hf = "model";  // the same setting on every rank, each reading its own copy
  bool named = false;
  try {
    train::Runtime rt(config);
    ADD_FAILURE() << "rank " << rank << " started on weights with a NaN";
  } catch (const FormatError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("holds NaN or infinite values"), std::string::npos) << message;
    named = message.find("tensor 'model.norm.weight'") != std::string::npos;
    EXPECT_TRUE(named || message.find("another rank found a tensor") != std::string::npos)
        << message;
  }
  {  // Some rank, the one whose shard holds the NaN, names the tensor.
    dist::DistEnv env;
    const int64_t naming = env.world().all_reduce_host(int64_t{named ? 1 : 0}, dist::ReduceOp::Sum);
    EXPECT_GE(naming, 1) << "no rank named the tensor";
  }
  std::filesystem::current_path(original);
  std::filesystem::remove_all(here);
}

// bench under mpirun: ranks started with different flags stop at once, each with the same
// message, instead of pairing collectives wrongly until dist.timeout_s.
TEST(StartUp, BenchRanksWithDifferentFlagsStop) {
  if (dist::job_world_size() < 2) GTEST_SKIP() << "needs several ranks";
  train::Config config =
      train::Config::parse(shardtrain::testing::kTinyRunYaml, {}, "start-up test");
  train::BenchOptions o;
  o.strategies = {"none"};
  o.precisions = {"fp32"};
  o.warmup_steps = 0;
  o.measured_steps = dist::job_rank() == dist::job_world_size() - 1 ? 2 : 1;
  try {
    train::run_bench(config, o);
    ADD_FAILURE() << "rank " << dist::job_rank() << " ran a bench whose flags differ";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("bench: the ranks were started with different "
                                         "--strategies, --precisions, --warmup or --steps"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
