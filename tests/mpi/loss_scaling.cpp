// fp16 loss scaling in sharded training steps. train_step leaves the gradient shards scaled and
// takes the overflow check and the norm from their sum of squares over every rank; the optimizer
// divides the scale out inside its update. That must be the classic step on every rank, bit for
// bit (unscale each shard in place, agree on an overflow, norm, clip in place, plain step), and
// an overflow must skip the step on all of them. Without loss scaling, non-finite gradients stop
// the step on every rank (none may go on alone into the next collective).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "bits.h"
#include "shardtrain/dist/env.h"
#include "shardtrain/fsdp/fsdp.h"
#include "shardtrain/optim/optimizer.h"
#include "shardtrain/train/runtime.h"
#include "split_batches.h"
#include "tiny_run.h"

using namespace shardtrain;

namespace {

constexpr float kLr = 1e-2f;

train::Config fp16_config(const std::string& sharding, const std::string& extra = "",
                          const std::string& compute = "fp16") {
  std::vector<std::string> sets = {"precision.compute=" + compute, "optim.grad_clip=0.05",
                                   "dist.sharding=" + sharding};
  if (sharding == "hybrid_shard") sets.push_back("dist.ranks_per_node=2");
  if (!extra.empty()) sets.push_back(extra);
  return train::Config::parse(shardtrain::testing::kTinyRunYaml, sets, "loss scaling test");
}

// This rank's micro-batches: two of one sequence each, different on every rank.
std::vector<Batch> rank_batches(const train::Config& config, int rank) {
  const std::vector<Batch> all =
      shardtrain::testing::first_batches(config, Split::Train, 2 * rank + 2, 1);
  return {all[static_cast<size_t>(2 * rank)], all[static_cast<size_t>(2 * rank + 1)]};
}

// This rank's shard of the trainable weights, as bit patterns.
std::vector<std::vector<uint32_t>> shard_bits(train::Runtime& rt) {
  std::vector<std::vector<uint32_t>> out;
  for (const optim::NamedParam& p : rt.trainable())
    out.push_back(shardtrain::testing::bits_of(*p.param));
  return out;
}

class ShardedLossScaling : public ::testing::TestWithParam<std::string> {};

TEST_P(ShardedLossScaling, TrainStepIsTheStepOnShardsUnscaledAndClippedInPlace) {
  const train::Config config = fp16_config(GetParam());
  const std::vector<Batch> batches = rank_batches(config, dist::job_rank());

  train::Runtime fused(config);
  ASSERT_NE(fused.sharded(), nullptr) << "the premise: more than one rank";
  ASSERT_TRUE(fused.scaler().enabled());
  const train::StepResult r = fused.train_step(batches, kLr);
  ASSERT_FALSE(r.skipped);

  train::Runtime classic(config);
  classic.optimizer().zero_grad();
  ASSERT_FALSE(classic.forward_backward(batches).found_inf);
  const double sum_squares = classic.sharded()->grad_sum_squares();
  const double norm = optim::clip_grad_norm(classic.trainable(), 0.05, sum_squares);
  classic.optimizer().step(kLr);

  ASSERT_GT(norm, 0.1) << "the premise: this step is clipped";
  EXPECT_EQ(r.grad_norm, norm);
  EXPECT_EQ(shard_bits(fused), shard_bits(classic));
}

TEST_P(ShardedLossScaling, OverflowSkipsTheStepOnEveryRank) {
  // 2^40 overflows the fp16 gradients of the first backward on every rank.
  const train::Config config = fp16_config(GetParam(), "precision.init_scale=1099511627776");
  train::Runtime rt(config);
  const std::vector<std::vector<uint32_t>> before = shard_bits(rt);
  const train::StepResult r = rt.train_step(rank_batches(config, dist::job_rank()), kLr);
  EXPECT_TRUE(r.skipped);
  EXPECT_TRUE(std::isinf(r.grad_norm));
  EXPECT_EQ(shard_bits(rt), before);
  EXPECT_EQ(rt.optimizer().steps_taken(), 0);
  EXPECT_EQ(rt.scaler().scale(), 549755813888.0f);
}

TEST_P(ShardedLossScaling, NonFiniteGradientsStopEveryRankWithoutLossScaling) {
  const train::Config config = fp16_config(GetParam(), "", "bf16");
  train::Runtime rt(config);
  ASSERT_FALSE(rt.scaler().enabled());
  // An inf in rank 0's piece of the first parameter: every rank's forward and backward meet it.
  if (dist::job_rank() == 0) {
    Tensor& shard = *rt.trainable().front().param;
    ASSERT_GT(shard.numel(), 0);
    shard.data<float>()[0] = INFINITY;
  }
  const std::vector<std::vector<uint32_t>> before = shard_bits(rt);
  try {
    rt.train_step(rank_batches(config, dist::job_rank()), kLr);
    ADD_FAILURE() << "rank " << dist::job_rank() << " went ahead with non-finite gradients";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("inf or nan"), std::string::npos) << e.what();
  }
  EXPECT_EQ(shard_bits(rt), before);
  EXPECT_EQ(rt.optimizer().steps_taken(), 0);
}

INSTANTIATE_TEST_SUITE_P(Shardings, ShardedLossScaling,
                         ::testing::Values("full_shard", "grad_op_shard", "no_shard",
                                           "hybrid_shard"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
