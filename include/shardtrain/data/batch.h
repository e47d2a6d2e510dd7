// A batch of next-token-prediction examples, and splitting it into micro-batches.
#pragma once
#include <cstdint>
#include <vector>

#include "shardtrain/tensor/tensor.h"

namespace shardtrain {

// Target id that the loss skips (as in PyTorch's cross_entropy).
constexpr int64_t kIgnoreIndex = -100;

struct Batch {
  Tensor input_ids;  // i64 [B, S] on the CPU device
  Tensor targets;    // i64 [B, S]; targets[b, t] is the token to predict after input_ids[b, t]
  int64_t num_target_tokens = 0;  // targets that are not kIgnoreIndex

  int64_t batch_size() const { return input_ids.size(0); }
  int64_t seq_len() const { return input_ids.size(1); }
  // Rows [start, start + count), sharing storage, with its own target count.
  Batch slice(int64_t start, int64_t count) const;
};

// Targets that are not kIgnoreIndex.
int64_t count_target_tokens(const Tensor& targets);

// Splits along dim 0 into `num_micro_batches` equal micro-batches (views of the batch); throws
// ConfigError when the batch size is not a multiple of `num_micro_batches`.
std::vector<Batch> split_batch(const Batch& batch, int64_t num_micro_batches);

}  // namespace shardtrain
