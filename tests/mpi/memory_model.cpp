// The memory model's per-rank prediction against the peak each rank measures, under mpirun, for
// every sharding strategy: no_shard (each rank a whole replica, kept as one-shard units), the
// sharded ones, gradient accumulation with and without reducing every micro-batch, and 16-bit
// gradient reductions. Mostly fp32, so that the CPU backend's fp32 scratch copies of 16-bit
// operands (which no GPU makes) do not blur the comparison.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "shardtrain/dist/env.h"
#include "shardtrain/train/bench.h"
#include "shardtrain/train/config.h"
#include "shardtrain/train/memory_model.h"

using namespace shardtrain;

namespace {

// configs/tiny.yaml's model (4 layers, hidden 128, vocab 256) on short sequences, so that the
// model states and the sharding's buffers, not the activations, decide the peak.
constexpr const char* kYaml = R"(
model:
  vocab_size: 256
  hidden_size: 128
  intermediate_size: 352
  num_layers: 4
  num_heads: 4
  num_kv_heads: 2
  max_seq_len: 32
train:
  steps: 4
  seq_len: 32
  micro_batch: 2
  eval_every: 0
  progress: none
  device: cpu
  seed: 3
dist:
  timeout_s: 120
checkpoint:
  every_steps: 0
)";

struct Case {
  std::vector<std::string> overrides;
  int sequences_per_rank = 2;  // per step
};

class PredictedPeak : public ::testing::TestWithParam<Case> {};

TEST_P(PredictedPeak, IsWithinThreePercentOfTheMeasuredOne) {
  const int world = dist::job_world_size();
  std::vector<std::string> overrides = GetParam().overrides;
  overrides.push_back("train.global_batch=" +
                      std::to_string(GetParam().sequences_per_rank * world));
  const train::Config config = train::Config::parse(kYaml, overrides, "memory model test");
  const train::MemoryModelInput in = train::MemoryModelInput::from_config(config, world);
  const train::MemoryPrediction predicted = train::predict_memory(in);
  const train::BenchRow measured = train::measure_config(config, 1, 1);
  ASSERT_EQ(measured.status, train::BenchStatus::Ok) << measured.message;
  const double error = static_cast<double>(predicted.peak - measured.peak_bytes) /
                       static_cast<double>(measured.peak_bytes);
  EXPECT_LE(std::abs(error), 0.03)
      << "rank " << measured.rank << " of " << world << ": predicted " << predicted.peak
      << " bytes at " << predicted.peak_moment << ", measured " << measured.peak_bytes;
}

std::string name_of(const ::testing::TestParamInfo<Case>& info) {
  std::string name;
  for (const std::string& o : info.param.overrides) {
    std::string key = o.substr(0, o.find('=')), value = o.substr(o.find('=') + 1);
    if (key == "train.micro_batch") continue;
    if (!name.empty()) name += "_";
    name += key == "dist.sync_every_microbatch" ? (value == "true" ? "sync_every" : "sync_last")
                                                : value;
  }
  return name;
}

INSTANTIATE_TEST_SUITE_P(
    EveryStrategy, PredictedPeak,
    ::testing::Values(
        Case{{"dist.sharding=no_shard"}},
        Case{{"dist.sharding=no_shard", "activation.strategy=per_layer"}},
        Case{{"dist.sharding=full_shard"}},
        Case{{"dist.sharding=grad_op_shard", "activation.strategy=per_layer"}},
        // Four micro-batches a step: gradients kept between them, sharded when
        // every micro-batch reduces, whole (4 bytes a parameter) when only the
        // last one does.
        Case{{"dist.sharding=full_shard", "train.micro_batch=1", "dist.sync_every_microbatch=true"},
             4},
        Case{
            {"dist.sharding=full_shard", "train.micro_batch=1", "dist.sync_every_microbatch=false"},
            4},
        // One and two layers: nothing to prefetch after the last.
        Case{{"dist.sharding=full_shard", "model.num_layers=1"}},
        Case{{"dist.sharding=full_shard", "model.num_layers=2"}},
        // 16-bit reductions, which MPI runs on fp32 copies of their buffers.
        Case{{"dist.sharding=full_shard", "precision.reduce_dtype=bf16"}},
        Case{{"dist.sharding=grad_op_shard", "precision.compute=bf16",
              "precision.reduce_dtype=bf16"}},
        Case{{"dist.sharding=no_shard", "precision.compute=bf16", "precision.reduce_dtype=bf16"}}),
    name_of);

}  // namespace
