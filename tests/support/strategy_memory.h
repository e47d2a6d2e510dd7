// The model, the strategy variants and the memory checks that the CPU and GPU activation-strategy
// tests (tests/unit/test_activation.cpp, tests/cuda/training.cpp) share.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "shardtrain/activation/estimate.h"
#include "shardtrain/nn/llama.h"

namespace shardtrain::testing {

// Scores dominate: [B*heads, S, S] probabilities are 32x a [T, hidden] activation, so each
// strategy's saving shows. Head dim 8.
inline nn::LlamaConfig memory_config() {
  nn::LlamaConfig c;
  c.vocab_size = 256;
  c.hidden_size = 32;
  c.intermediate_size = 64;
  c.num_layers = 4;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.max_seq_len = 256;
  return c;
}
inline constexpr int64_t kMemoryBatch = 1, kMemorySeq = 256;

// The formulas' description of a model of config `c` (fp32) on [batch, seq] tokens.
inline activation::ActivationModelShape shape_of(const nn::LlamaConfig& c, int64_t batch,
                                                 int64_t seq, ops::AttentionImpl impl) {
  activation::ActivationModelShape s;
  s.batch = batch;
  s.seq = seq;
  s.hidden = c.hidden_size;
  s.heads = c.num_heads;
  s.kv_heads = c.num_kv_heads;
  s.intermediate = c.intermediate_size;
  s.vocab = c.vocab_size;
  s.layers = c.num_layers;
  s.dtype_bytes = 4;
  s.attention_impl = impl;
  return s;
}

inline void expect_near_fraction(int64_t measured, int64_t predicted, double tolerance,
                                 const std::string& what) {
  const double rel =
      std::abs(static_cast<double>(measured - predicted)) / static_cast<double>(predicted);
  EXPECT_LE(rel, tolerance) << what << ": measured " << measured << " bytes, predicted "
                            << predicted;
}

struct StrategyVariant {
  std::string strategy;
  bool reentrant;
  std::string name() const { return strategy + (reentrant ? " (reentrant)" : ""); }
};

// Every strategy but none, with each checkpoint implementation it has.
inline const std::vector<StrategyVariant>& strategy_variants() {
  static const std::vector<StrategyVariant> v = {
      {"per_layer", false},   {"per_layer", true},           {"sqrt_segment", false},
      {"sqrt_segment", true}, {"selective", false},          {"selective", true},
      {"offload", false},     {"offload_checkpoint", false}, {"offload_checkpoint", true}};
  return v;
}

// The regions `strategy` re-runs (once each per backward) on memory_config()'s `layers` (4):
// one per layer, two sqrt_segment segments, none under offload.
inline int64_t rerun_regions(const std::string& strategy, int64_t layers) {
  return strategy == "sqrt_segment" ? 2 : (strategy == "offload" ? 0 : layers);
}

// Strategy none on memory_config()'s batch: nothing re-run, only ids and targets alive before
// the forward, and the memory the formulas predict. `Step` is the test's step figures.
template <typename Step>
inline void expect_none_as_estimated(const Step& none,
                                     const activation::ActivationModelShape& shape) {
  EXPECT_EQ(none.counters.forward_reruns, 0);
  EXPECT_EQ(none.baseline, 2 * 2048) << "only ids and targets should be alive before forward";
  const activation::ActivationEstimate e = activation::activation_bytes_model("none", shape);
  EXPECT_EQ(none.after_forward, e.after_forward);
  expect_near_fraction(none.peak, e.peak, 0.05, "none peak");
}

// A variant's step uses the device and host memory its formula predicts (peaks within 5%) and
// leaves nothing in the host pool after backward.
template <typename Step>
inline void expect_as_estimated(const Step& r, const StrategyVariant& v,
                                const activation::ActivationModelShape& shape) {
  const activation::ActivationEstimate e =
      activation::activation_bytes_model(v.strategy, shape, v.reentrant);
  EXPECT_EQ(r.after_forward, e.after_forward);
  expect_near_fraction(r.forward_peak, e.forward_peak, 0.05, v.name() + " forward peak");
  expect_near_fraction(r.peak, e.peak, 0.05, v.name() + " peak");
  EXPECT_EQ(r.host_after_forward, e.host_bytes);
  EXPECT_EQ(r.host_after_backward, 0) << "offloaded copies must be freed by backward";
}

// What each strategy buys when the scores dominate; `peaks` by strategy (none included).
inline void expect_strategy_peak_order(std::map<std::string, int64_t> peaks) {
  EXPECT_LT(peaks["offload_checkpoint"], peaks["per_layer"]);
  EXPECT_LT(peaks["per_layer"], peaks["selective"]);
  EXPECT_LT(peaks["selective"], peaks["none"]);
  EXPECT_LT(peaks["per_layer"], peaks["sqrt_segment"]);
  EXPECT_LT(peaks["sqrt_segment"], peaks["none"]);
  EXPECT_LT(peaks["offload"], peaks["none"]);
}

}  // namespace shardtrain::testing
