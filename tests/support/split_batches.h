// Batches read in order from a config's data split, for tests that need the same inputs on every
// rank (or in every runtime) without a training loop's sampler state.
#pragma once
#include <cstdint>
#include <vector>

#include "shardtrain/data/sampler.h"
#include "shardtrain/data/token_dataset.h"
#include "shardtrain/train/config.h"

namespace shardtrain::testing {

// The first `count` batches of `sequences` sequences each of `split`, unshuffled.
inline std::vector<Batch> first_batches(const train::Config& config, Split split, int count,
                                        int64_t sequences) {
  TokenDataset data = load_token_source(config.data.path);
  SamplerConfig sc;
  sc.seq_len = config.train.seq_len;
  sc.eval_fraction = config.data.eval_fraction;
  sc.shuffle = false;
  Sampler sampler(data, split, sc);
  std::vector<Batch> batches;
  for (int i = 0; i < count; ++i) batches.push_back(sampler.next_batch(sequences));
  return batches;
}

}  // namespace shardtrain::testing
