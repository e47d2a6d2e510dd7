// Evaluation under mpirun: each rank evaluates its share of the held-out batches, and the mean
// over all of them equals the token-weighted mean of the batches evaluated one at a time, also
// when the batch count does not divide by the number of ranks (ranks without a batch of their own
// still take part in the sharded forward).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "shardtrain/data/sampler.h"
#include "shardtrain/data/token_dataset.h"
#include "shardtrain/dist/env.h"
#include "shardtrain/train/runtime.h"
#include "tiny_run.h"

using namespace shardtrain;

namespace {

std::vector<Batch> eval_batches(const train::Config& config, int count) {
  TokenDataset data = load_token_source(config.data.path);
  SamplerConfig sc;
  sc.seq_len = config.train.seq_len;
  sc.eval_fraction = config.data.eval_fraction;
  sc.shuffle = false;
  Sampler sampler(data, Split::Eval, sc);
  std::vector<Batch> batches;
  for (int i = 0; i < count; ++i) batches.push_back(sampler.next_batch(2));
  return batches;
}

TEST(ShardedEval, MeanOverRanksEqualsTheBatchesOneByOne) {
  for (const char* sharding : {"full_shard", "no_shard"}) {
    train::Config config =
        train::Config::parse(shardtrain::testing::kTinyRunYaml,
                             {std::string("dist.sharding=") + sharding}, "sharded eval test");
    train::Runtime rt(config);
    const int ranks = rt.dist().world_size();
    // One batch fewer than a multiple of the ranks, and fewer batches than ranks.
    for (int count : {2 * ranks - 1, ranks - 1}) {
      if (count == 0) continue;
      std::vector<Batch> batches = eval_batches(config, count);
      // Reference: one batch per call (only rank 0 counts it; the others run it uncounted).
      double weighted = 0;
      int64_t tokens = 0;
      for (const Batch& b : batches) {
        weighted += rt.eval_loss({b}) * static_cast<double>(b.num_target_tokens);
        tokens += b.num_target_tokens;
      }
      const double expected = weighted / static_cast<double>(tokens);
      const double got = rt.eval_loss(batches);
      EXPECT_NEAR(got, expected, 1e-12 * expected) << sharding << ", " << count << " batches";
      EXPECT_GT(got, 1.0) << "an untrained model's loss on bytes is several nats";
    }
  }
}

}  // namespace
