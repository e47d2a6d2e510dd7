// Evaluation under mpirun: each rank evaluates its share of the held-out batches, and the mean
// over all of them equals the token-weighted mean of the same batches through an unsharded copy
// of the model on every rank, also when the batch count does not divide by the number of ranks
// (ranks without a batch of their own still take part in the sharded forward).
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

#include "shardtrain/autograd/grad_mode.h"
#include "shardtrain/dist/env.h"
#include "shardtrain/nn/llama.h"
#include "shardtrain/train/runtime.h"
#include "split_batches.h"
#include "tiny_run.h"

using namespace shardtrain;

namespace {

TEST(ShardedEval, MeanOverRanksEqualsTheUnshardedModel) {
  for (const char* sharding : {"full_shard", "no_shard"}) {
    train::Config config =
        train::Config::parse(shardtrain::testing::kTinyRunYaml,
                             {std::string("dist.sharding=") + sharding}, "sharded eval test");
    train::Runtime rt(config);
    const int ranks = rt.dist().world_size();
    ASSERT_GT(ranks, 1) << "run under mpirun with several ranks";
    // The same weights, whole, on this rank: the sharded initialisation gives each rank exactly
    // its elements of the full one.
    nn::LlamaModel whole(train::llama_config_from(config.model), Device::cpu());
    whole.init_weights(static_cast<uint64_t>(config.train.seed));
    // One batch fewer than a multiple of the ranks, and fewer batches than ranks.
    for (int count : {2 * ranks - 1, ranks - 1}) {
      std::vector<Batch> batches =
          shardtrain::testing::first_batches(config, Split::Eval, count, 2);
      double sum = 0;
      int64_t tokens = 0;
      {
        autograd::NoGrad no_grad;
        for (const Batch& b : batches) {
          sum += whole.loss_sum(b.input_ids, b.targets).item();
          tokens += b.num_target_tokens;
        }
      }
      const double expected = sum / static_cast<double>(tokens);
      const double got = rt.eval_loss(batches);
      EXPECT_NEAR(got, expected, 1e-6 * expected) << sharding << ", " << count << " batches";
      EXPECT_GT(got, 1.0) << "an untrained model's loss on bytes is several nats";
    }
  }
}

// A stop asked on one rank only (the last) at its third round ends the evaluation on every rank
// at that round: each has run exactly three rounds' forwards, none returns a loss, and the
// collectives stay matched (the evaluation after it, with no stop, gives the full mean).
TEST(ShardedEval, AStopOnOneRankAbandonsTheEvaluationOnAll) {
  for (const char* sharding : {"full_shard", "no_shard"}) {
    train::Config config =
        train::Config::parse(shardtrain::testing::kTinyRunYaml,
                             {std::string("dist.sharding=") + sharding}, "sharded eval test");
    train::Runtime rt(config);
    const int ranks = rt.dist().world_size(), rank = rt.dist().rank();
    std::vector<Batch> batches =
        shardtrain::testing::first_batches(config, Split::Eval, 5 * ranks, 2);
    int asked = 0;
    std::optional<double> abandoned = rt.eval_loss(batches, [&] {
      ++asked;
      return rank == ranks - 1 && asked == 3;
    });
    EXPECT_FALSE(abandoned.has_value()) << sharding << ": rank " << rank << " evaluated to the end";
    EXPECT_EQ(asked, 3) << sharding << ": rank " << rank;
    const double full = rt.eval_loss(batches);
    std::optional<double> again = rt.eval_loss(batches, [] { return false; });
    ASSERT_TRUE(again.has_value());
    EXPECT_EQ(*again, full) << sharding;
  }
}

}  // namespace
