// Deterministic sampling of training windows from a token stream.
//
// The stream is split once: the last `eval_fraction` of the tokens is held out, the rest is for
// training, and no window crosses the boundary. Each split is cut into windows of seq_len + 1
// tokens starting every seq_len tokens (input = the first seq_len, target = the same shifted by
// one, so every token of the split is predicted once per epoch). The training order is a
// permutation of the windows drawn from (seed, epoch), so the pair (epoch, position) is all the
// state a checkpoint needs to resume the exact same sequence of batches.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "shardtrain/data/batch.h"
#include "shardtrain/data/token_dataset.h"

namespace shardtrain {

enum class Split { Train, Eval };

struct SamplerConfig {
  int64_t seq_len = 128;
  double eval_fraction = 0.0;  // in [0, 1)
  uint64_t seed = 0;
  bool shuffle = true;  // false: windows in stream order (e.g. for evaluation)
};

struct SamplerState {
  uint64_t seed = 0;
  int64_t epoch = 0;
  int64_t position = 0;  // windows already taken in this epoch
  // TokenDataset::checksum of the tokens the sampler walks (0: not recorded). restore() does not
  // need it; a resumed run compares it with its data's to say when the data changed.
  uint64_t data_checksum = 0;
  bool operator==(const SamplerState&) const = default;
};

class Sampler {
 public:
  // Throws ConfigError naming the dataset when the split is too short for one window.
  Sampler(const TokenDataset& data, Split split, const SamplerConfig& config);

  Split split() const { return split_; }
  int64_t seq_len() const { return config_.seq_len; }
  int64_t num_windows() const { return num_windows_; }
  // This split's tokens are [split_begin(), split_end()) of the stream.
  int64_t split_begin() const { return begin_; }
  int64_t split_end() const { return end_; }

  // The next `batch_size` windows (continuing into the next epoch when this one runs out).
  Batch next_batch(int64_t batch_size) { return next_batch_rows(batch_size, 0, batch_size); }
  // Rows [first, first + count) of the next `batch_size` windows; advances past all of them.
  // Each rank reads only its share of a global batch, and every rank's sampler stays in step.
  Batch next_batch_rows(int64_t batch_size, int64_t first, int64_t count);
  // Stream offset of the window taken at `position` of the current epoch.
  int64_t window_start(int64_t position) const;

  SamplerState state() const { return {config_.seed, epoch_, position_, data_.checksum()}; }
  // Continues exactly where `state` was taken; throws ConfigError for an impossible state.
  void restore(const SamplerState& state);
  // Advances by `num_windows` windows without producing them.
  void skip(int64_t num_windows);

 private:
  void build_order();

  TokenDataset data_;  // a copy shares the tokens
  Split split_;
  SamplerConfig config_;
  int64_t begin_ = 0;
  int64_t end_ = 0;
  int64_t num_windows_ = 0;
  int64_t epoch_ = 0;
  int64_t position_ = 0;
  std::vector<int64_t> order_;  // window indices of the current epoch (empty: identity)
};

}  // namespace shardtrain
