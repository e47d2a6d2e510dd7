#include "shardtrain/data/sampler.h"

#include <cmath>

#include "shardtrain/core/error.h"
#include "shardtrain/data/splitmix.h"

namespace shardtrain {

using detail::concat;

// ---- Batch ------------------------------------------------------------------------------------

int64_t count_target_tokens(const Tensor& targets) {
  int64_t n = 0;
  for (int64_t t : targets.to_int_vector()) n += t != kIgnoreIndex ? 1 : 0;
  return n;
}

Batch Batch::slice(int64_t start, int64_t count) const {
  Batch out;
  out.input_ids = input_ids.slice_rows(start, count);
  out.targets = targets.slice_rows(start, count);
  out.num_target_tokens = count_target_tokens(out.targets);
  return out;
}

std::vector<Batch> split_batch(const Batch& batch, int64_t num_micro_batches) {
  const int64_t b = batch.batch_size();
  ST_CHECK_AS(ConfigError, num_micro_batches >= 1 && b % num_micro_batches == 0,
              "cannot split a batch of ", b, " sequences into ", num_micro_batches,
              " equal micro-batches: the batch size must be a multiple of the number of "
              "micro-batches");
  const int64_t rows = b / num_micro_batches;
  std::vector<Batch> out;
  out.reserve(static_cast<size_t>(num_micro_batches));
  for (int64_t i = 0; i < num_micro_batches; ++i) out.push_back(batch.slice(i * rows, rows));
  return out;
}

// ---- Sampler ----------------------------------------------------------------------------------

Sampler::Sampler(const TokenDataset& data, Split split, const SamplerConfig& config)
    : data_(data), split_(split), config_(config) {
  const char* split_name = split == Split::Train ? "training" : "held-out";
  ST_CHECK_AS(ConfigError, config.seq_len >= 1, "seq_len must be at least 1, got ", config.seq_len);
  ST_CHECK_AS(ConfigError, config.eval_fraction >= 0.0 && config.eval_fraction < 1.0,
              "eval_fraction must be in [0, 1), got ", config.eval_fraction);
  const int64_t n = data.size();
  const auto n_eval =
      static_cast<int64_t>(std::floor(static_cast<double>(n) * config.eval_fraction));
  if (split == Split::Train) {
    begin_ = 0;
    end_ = n - n_eval;
  } else {
    ST_CHECK_AS(ConfigError, config.eval_fraction > 0.0, data.source(),
                ": no held-out tokens: set eval_fraction above 0 to evaluate");
    begin_ = n - n_eval;
    end_ = n;
  }
  // Window k covers [begin + k*S, begin + k*S + S + 1): consecutive windows share one token.
  const int64_t length = end_ - begin_;
  num_windows_ = length >= 1 ? (length - 1) / config.seq_len : 0;
  ST_CHECK_AS(
      ConfigError, num_windows_ >= 1, data.source(), ": the ", split_name, " split has ", length,
      " tokens (of ", n, " with eval_fraction ", config.eval_fraction,
      "), too few for one window of seq_len + 1 = ", config.seq_len + 1, " tokens; use more data",
      split == Split::Eval ? ", a larger data.eval_fraction" : ", a smaller data.eval_fraction",
      " or a shorter seq_len");
  build_order();
}

void Sampler::build_order() {
  order_.clear();
  if (!config_.shuffle) return;
  order_.resize(static_cast<size_t>(num_windows_));
  for (int64_t i = 0; i < num_windows_; ++i) order_[static_cast<size_t>(i)] = i;
  SplitMix64 rng(mix_seed(config_.seed, static_cast<uint64_t>(epoch_)));
  for (int64_t i = num_windows_ - 1; i > 0; --i) {
    auto j = static_cast<int64_t>(rng.below(static_cast<uint64_t>(i + 1)));
    std::swap(order_[static_cast<size_t>(i)], order_[static_cast<size_t>(j)]);
  }
}

int64_t Sampler::window_start(int64_t position) const {
  ST_CHECK_AS(ConfigError, position >= 0 && position < num_windows_, "window position ", position,
              " is outside [0, ", num_windows_, ")");
  const int64_t index = order_.empty() ? position : order_[static_cast<size_t>(position)];
  return begin_ + index * config_.seq_len;
}

Batch Sampler::next_batch_rows(int64_t batch_size, int64_t first, int64_t count) {
  ST_CHECK_AS(ConfigError, batch_size >= 1, "batch size must be at least 1, got ", batch_size);
  ST_CHECK(first >= 0 && count >= 1 && first + count <= batch_size, "rows [", first, ", ",
           first + count, ") are not within a batch of ", batch_size);
  const int64_t s = config_.seq_len;
  Batch batch;
  batch.input_ids = empty({count, s}, DType::I64, Device::cpu());
  batch.targets = empty({count, s}, DType::I64, Device::cpu());
  auto* inputs = batch.input_ids.data<int64_t>();
  auto* targets = batch.targets.data<int64_t>();
  std::vector<uint32_t> window(static_cast<size_t>(s + 1));
  skip(first);
  for (int64_t b = 0; b < count; ++b) {
    data_.read(window_start(position_), s + 1, window.data());
    for (int64_t t = 0; t < s; ++t) {
      inputs[b * s + t] = window[t];
      targets[b * s + t] = window[t + 1];
    }
    skip(1);
  }
  skip(batch_size - first - count);
  batch.num_target_tokens = count * s;
  return batch;
}

void Sampler::restore(const SamplerState& state) {
  ST_CHECK_AS(ConfigError, state.epoch >= 0, "cannot restore sampler state (epoch ", state.epoch,
              ", position ", state.position,
              "): the epoch is negative, which no run writes: the checkpoint is damaged");
  ST_CHECK_AS(ConfigError, state.position >= 0 && state.position < num_windows_,
              "cannot restore sampler state (epoch ", state.epoch, ", position ", state.position,
              "): the position must be in [0, ", num_windows_,
              ") for this dataset and seq_len; was the checkpoint made with other data?");
  config_.seed = state.seed;
  epoch_ = state.epoch;
  position_ = state.position;
  build_order();
}

void Sampler::skip(int64_t num_windows) {
  ST_CHECK_AS(ConfigError, num_windows >= 0, "cannot skip ", num_windows, " windows");
  const int64_t total = position_ + num_windows;
  const int64_t epochs = total / num_windows_;
  position_ = total % num_windows_;
  if (epochs > 0) {
    epoch_ += epochs;
    build_order();
  }
}

}  // namespace shardtrain
