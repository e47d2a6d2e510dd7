// A tiny Llama and deterministic token batches shared by the sharded-training tests, plus the
// single-process computation they are checked against.
#pragma once
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "shardtrain/autograd/engine.h"
#include "shardtrain/nn/llama.h"
#include "shardtrain/ops/ops.h"
#include "shardtrain/optim/optimizer.h"

namespace shardtrain::test {

inline nn::LlamaConfig tiny_config(int layers = 2) {
  nn::LlamaConfig c;
  c.vocab_size = 64;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_layers = layers;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.max_seq_len = 16;
  c.init_std = 0.2f;  // large enough that gradients are far from zero
  return c;
}

struct MicroBatch {
  Tensor ids, targets;  // I64 [batch, seq]
  int64_t tokens = 0;   // targets that are not -100
};

// `count` micro-batches of [batch, seq] tokens; every 7th target is ignored (-100).
inline std::vector<MicroBatch> make_micro_batches(int count, int64_t batch, int64_t seq,
                                                  int64_t vocab, uint64_t seed) {
  std::vector<MicroBatch> out;
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  auto next = [&state]() {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  };
  for (int m = 0; m < count; ++m) {
    std::vector<int64_t> ids(static_cast<size_t>(batch * seq)), targets(ids.size());
    MicroBatch mb;
    for (size_t i = 0; i < ids.size(); ++i) {
      ids[i] = static_cast<int64_t>(next() % static_cast<uint64_t>(vocab));
      targets[i] = (i + static_cast<size_t>(m)) % 7 == 3
                       ? -100
                       : static_cast<int64_t>(next() % static_cast<uint64_t>(vocab));
      if (targets[i] != -100) ++mb.tokens;
    }
    mb.ids = from_ints(ids, {batch, seq});
    mb.targets = from_ints(targets, {batch, seq});
    out.push_back(mb);
  }
  return out;
}

inline int64_t total_tokens(const std::vector<MicroBatch>& mbs) {
  int64_t n = 0;
  for (const auto& mb : mbs) n += mb.tokens;
  return n;
}

// Summed cross-entropy of the micro-batches, each divided by `global_tokens` before backward
// (the training step's normalisation). Returns the sum of the unscaled losses.
inline double forward_backward(nn::LlamaModel& model, const std::vector<MicroBatch>& mbs,
                               int64_t global_tokens) {
  double sum = 0;
  for (const auto& mb : mbs) {
    Tensor loss = model.loss_sum(mb.ids, mb.targets);
    sum += loss.item();
    autograd::backward(ops::scale(loss, 1.0f / static_cast<float>(global_tokens)));
  }
  return sum;
}

using NamedValues = std::map<std::string, std::vector<float>>;

inline NamedValues grads_of(nn::LlamaModel& model) {
  NamedValues out;
  for (auto& [name, slot] : model.named_parameters())
    out[name] = autograd::grad(*slot).to_float_vector();
  return out;
}

inline NamedValues params_of(nn::LlamaModel& model) {
  NamedValues out;
  for (auto& [name, slot] : model.named_parameters()) out[name] = slot->to_float_vector();
  return out;
}

// Largest |a - b| / (|b| + floor) over the elements, with floor = 0.1 * max|b|: a result below
// rtol means |a - b| <= rtol * |b| + (rtol / 10) * max|b| everywhere (numpy's allclose with an
// absolute tolerance tied to the tensor's scale), so that elements near zero, whose relative
// error any change of summation order inflates, do not decide alone.
inline double max_relative_error(const std::vector<float>& a, const std::vector<float>& b) {
  double scale = 0;
  for (float v : b) scale = std::max(scale, static_cast<double>(std::fabs(v)));
  double floor = 0.1 * scale + 1e-30, worst = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const double e = std::fabs(static_cast<double>(a[i]) - b[i]) / (std::fabs(b[i]) + floor);
    if (!(e <= worst)) worst = std::isnan(e) ? INFINITY : e;  // a NaN is the worst error
  }
  return a.size() == b.size() ? worst : INFINITY;
}

}  // namespace shardtrain::test
