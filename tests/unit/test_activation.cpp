// Activation-memory strategies: every strategy gives bitwise the gradients of `none`, re-runs the
// regions it should exactly once, and uses the device activation memory its formula predicts.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>

#include "model_step.h"
#include "shardtrain/activation/checkpoint.h"
#include "shardtrain/activation/counters.h"
#include "shardtrain/activation/estimate.h"
#include "shardtrain/activation/offload.h"
#include "shardtrain/activation/strategy.h"
#include "shardtrain/autograd/engine.h"
#include "shardtrain/autograd/grad_mode.h"
#include "shardtrain/autograd/node.h"
#include "shardtrain/nn/llama.h"
#include "strategy_memory.h"

using namespace shardtrain;
using namespace shardtrain::activation;

namespace {

using shardtrain::testing::expect_near_fraction;
using shardtrain::testing::memory_config;
using shardtrain::testing::shape_of;

// The batch of memory_config(): one sequence of 256 tokens.
constexpr int64_t kBatch = shardtrain::testing::kMemoryBatch,
                  kSeq = shardtrain::testing::kMemorySeq;

std::unique_ptr<nn::LlamaModel> make_model(const nn::LlamaConfig& c, ops::AttentionImpl impl) {
  auto m = std::make_unique<nn::LlamaModel>(c, Device::cpu());
  m->init_weights(1234);
  m->set_attention_impl(impl);
  return m;
}

struct Batch {
  Tensor ids, targets;
};

Batch make_batch(int64_t batch, int64_t seq, int64_t vocab, uint64_t seed) {
  Generator gen(seed);
  std::vector<float> u(static_cast<size_t>(batch * seq * 2));
  gen.uniform(u.data(), static_cast<int64_t>(u.size()));
  std::vector<int64_t> ids, targets;
  for (int64_t i = 0; i < batch * seq; ++i) {
    ids.push_back(static_cast<int64_t>(u[static_cast<size_t>(i)] * vocab) % vocab);
    // A few ignored targets, so the loss path with -100 runs as well.
    targets.push_back(i % 17 == 5
                          ? -100
                          : static_cast<int64_t>(u[static_cast<size_t>(batch * seq + i)] * vocab) %
                                vocab);
  }
  return {from_ints(ids, {batch, seq}), from_ints(targets, {batch, seq})};
}

struct StepResult : shardtrain::testing::LossAndGradients {
  int64_t baseline = 0;       // device activations in use before the forward (ids, targets)
  int64_t after_forward = 0;  // device activations in use when loss_sum returned
  int64_t host_after_forward = 0;
  int64_t host_after_backward = 0;
  int64_t peak = 0;  // device activation peak over forward and backward
  int64_t forward_peak = 0;
  int64_t nodes_run = 0;
  ActivationCounters counters;
};

StepResult run_step(nn::LlamaModel& model, const Batch& b) {
  shardtrain::testing::clear_gradients(model);
  reset_activation_counters();
  Allocator& dev = allocator_for(Device::cpu());
  Allocator& host = allocator_for(Device::host());
  StepResult r;
  dev.reset_peak();
  host.reset_peak();
  r.baseline = dev.stats().in_use_of(MemoryCategory::Activations);
  {
    Tensor loss = model.loss_sum(b.ids, b.targets);
    r.after_forward = dev.stats().in_use_of(MemoryCategory::Activations);
    r.forward_peak = dev.stats().peak_of(MemoryCategory::Activations);
    r.host_after_forward = host.stats().in_use_of(MemoryCategory::Offloaded);
    r.loss = loss.item();
    autograd::backward(loss);
    r.nodes_run = autograd::last_backward_stats().nodes_run;
  }
  r.peak = dev.stats().peak_of(MemoryCategory::Activations);
  r.host_after_backward = host.stats().in_use_of(MemoryCategory::Offloaded);
  r.counters = activation_counters();
  r.grads = shardtrain::testing::gradients_of(model);
  return r;
}

void expect_bitwise_equal(const StepResult& a, const StepResult& b, const std::string& what) {
  shardtrain::testing::expect_bitwise_equal_step(a, b, what, "strategy none");
}

}  // namespace

// ---- the strategies on a model ------------------------------------------------------------------

class StrategyTest : public ::testing::TestWithParam<ops::AttentionImpl> {};

TEST_P(StrategyTest, GradientsCountsAndMemoryMatchNoneAndTheFormula) {
  const ops::AttentionImpl impl = GetParam();
  const nn::LlamaConfig c = memory_config();
  const Batch batch = make_batch(kBatch, kSeq, c.vocab_size, 99);
  const ActivationModelShape shape = shape_of(c, kBatch, kSeq, impl);
  const int64_t L = c.num_layers;

  auto reference_model = make_model(c, impl);
  const StepResult none = run_step(*reference_model, batch);
  EXPECT_EQ(none.counters.bytes_offloaded, 0);
  shardtrain::testing::expect_none_as_estimated(none, shape);

  std::map<std::string, int64_t> peaks;
  peaks["none"] = none.peak;

  for (const shardtrain::testing::StrategyVariant& v : shardtrain::testing::strategy_variants()) {
    const std::string what = v.name();
    SCOPED_TRACE(what);
    auto model = make_model(c, impl);
    ActivationOptions options;
    options.strategy = v.strategy;
    options.reentrant = v.reentrant;
    apply_activation_strategy(*model, options);
    const StepResult r = run_step(*model, batch);
    expect_bitwise_equal(r, none, what);

    // Re-runs: one per region per backward.
    const int64_t regions = shardtrain::testing::rerun_regions(v.strategy, L);
    EXPECT_EQ(r.counters.forward_reruns, regions);
    if (regions > 0) {
      EXPECT_GT(r.counters.recompute_seconds, 0.0);
    }

    // The reentrant backward runs inner backwards; the engine counts their nodes in the outer
    // call: the region nodes and one accumulator per region input come on top of none's.
    if (v.reentrant) {
      int64_t inputs = v.strategy == "selective" ? 3 : 1;
      EXPECT_EQ(r.nodes_run, none.nodes_run + regions * (1 + inputs));
    } else {
      EXPECT_EQ(r.nodes_run, none.nodes_run);
    }

    EXPECT_EQ(r.baseline, none.baseline);
    shardtrain::testing::expect_as_estimated(r, v, shape);
    if (!v.reentrant) peaks[v.strategy] = r.peak;
  }

  shardtrain::testing::expect_strategy_peak_order(peaks);
}

INSTANTIATE_TEST_SUITE_P(Attention, StrategyTest,
                         ::testing::Values(ops::AttentionImpl::Plain, ops::AttentionImpl::Fused),
                         [](const auto& info) {
                           return info.param == ops::AttentionImpl::Plain ? "plain" : "fused";
                         });

// The formulas are not tuned to one shape: batch 2, grouped-query attention with an odd group
// count, five layers (sqrt_segment: 2 + 2 + 1), a vocabulary that is not a power of two.
TEST(Estimate, FormulaHoldsOnAnotherShape) {
  nn::LlamaConfig c;
  c.vocab_size = 100;
  c.hidden_size = 48;
  c.intermediate_size = 80;
  c.num_layers = 5;
  c.num_heads = 6;
  c.num_kv_heads = 3;
  c.max_seq_len = 96;
  const int64_t b = 2, s = 96;
  const Batch batch = make_batch(b, s, c.vocab_size, 41);
  for (auto impl : {ops::AttentionImpl::Plain, ops::AttentionImpl::Fused}) {
    const ActivationModelShape shape = shape_of(c, b, s, impl);
    for (const std::string& strategy : activation_strategies()) {
      for (bool reentrant : {false, true}) {
        if (reentrant && (strategy == "none" || strategy == "offload")) continue;
        std::string what = strategy + (reentrant ? " (reentrant)" : "") +
                           (impl == ops::AttentionImpl::Plain ? " plain" : " fused");
        auto model = make_model(c, impl);
        apply_activation_strategy(*model, {strategy, nullptr, reentrant, 0});
        const StepResult r = run_step(*model, batch);
        ActivationEstimate e = activation_bytes_model(strategy, shape, reentrant);
        EXPECT_EQ(r.after_forward, e.after_forward) << what;
        EXPECT_EQ(r.host_after_forward, e.host_bytes) << what;
        expect_near_fraction(r.forward_peak, e.forward_peak, 0.05, what + " forward peak");
        expect_near_fraction(r.peak, e.peak, 0.05, what + " peak");
      }
    }
  }
}

// A chunked loss (the head fused with the cross-entropy) under every strategy: no logits are
// kept, the measured bytes follow the formula, and the gradients are those of the whole-logits
// loss up to the regrouped sums over the chunks' rows.
TEST(Estimate, ChunkedLossKeepsNoLogits) {
  const nn::LlamaConfig c = memory_config();
  const Batch batch = make_batch(kBatch, kSeq, c.vocab_size, 7);
  const int64_t chunk = 100;  // 256 rows: chunks of 100, 100 and 56
  ActivationModelShape shape = shape_of(c, kBatch, kSeq, ops::AttentionImpl::Fused);
  const StepResult whole = run_step(*make_model(c, ops::AttentionImpl::Fused), batch);
  const int64_t logits = kBatch * kSeq * c.vocab_size * 4;
  EXPECT_EQ(whole.after_forward, activation_bytes_model("none", shape).after_forward);
  shape.loss_chunk = chunk;
  for (const std::string& strategy : activation_strategies()) {
    SCOPED_TRACE(strategy);
    auto model = make_model(c, ops::AttentionImpl::Fused);
    model->set_loss_chunk_rows(chunk);
    apply_activation_strategy(*model, {strategy, nullptr, false, 0});
    const StepResult r = run_step(*model, batch);
    ActivationEstimate e = activation_bytes_model(strategy, shape);
    EXPECT_EQ(r.after_forward, e.after_forward);
    expect_near_fraction(r.forward_peak, e.forward_peak, 0.05, strategy + " forward peak");
    expect_near_fraction(r.peak, e.peak, 0.05, strategy + " peak");
    if (strategy == "none") {
      EXPECT_EQ(r.after_forward, whole.after_forward - logits);
      EXPECT_LT(r.peak, whole.peak - logits / 2);
    }
    EXPECT_NEAR(r.loss, whole.loss, 1e-6 * std::fabs(whole.loss));
    for (const auto& [name, g] : whole.grads) {
      const std::vector<float>& h = r.grads.at(name);
      float largest = 0;
      for (float v : g) largest = std::max(largest, std::fabs(v));
      for (size_t i = 0; i < g.size(); ++i)
        ASSERT_NEAR(h[i], g[i], 1e-5f * largest) << name << " element " << i;
    }
  }
}

TEST(Offload, ForwardLeavesOnlyTheHeadOnTheDevice) {
  const nn::LlamaConfig c = memory_config();
  const Batch batch = make_batch(kBatch, kSeq, c.vocab_size, 5);
  const ActivationModelShape shape = shape_of(c, kBatch, kSeq, ops::AttentionImpl::Plain);
  auto model = make_model(c, ops::AttentionImpl::Plain);
  apply_activation_strategy(*model, {"offload", nullptr, false, 0});
  const StepResult r = run_step(*model, batch);

  // Device: ids, targets, the head's saved tensors and the loss; no layer keeps anything.
  const int64_t x = kBatch * kSeq * c.hidden_size * 4;
  const int64_t head = 2 * x + kBatch * kSeq * 4 + kBatch * kSeq * c.vocab_size * 4;
  EXPECT_EQ(r.after_forward, r.baseline + head + 64);
  // Host: every layer's saved tensors, each once.
  const int64_t per_layer =
      activation_bytes_per_layer("none", kBatch, kSeq, c.hidden_size, c.num_heads, c.num_kv_heads,
                                 c.intermediate_size, 4, ops::AttentionImpl::Plain);
  EXPECT_EQ(r.host_after_forward, c.num_layers * per_layer);
  EXPECT_EQ(r.counters.bytes_offloaded, c.num_layers * per_layer);
  EXPECT_EQ(r.counters.bytes_restored, r.counters.bytes_offloaded);
  EXPECT_GT(r.counters.transfer_seconds, 0.0);

  // A threshold above the rstd vectors (T f32 = 1 KiB) keeps them on the device.
  auto thresholded = make_model(c, ops::AttentionImpl::Plain);
  apply_activation_strategy(*thresholded, {"offload", nullptr, false, 2048});
  const StepResult t = run_step(*thresholded, batch);
  const int64_t rstd = kBatch * kSeq * 4;
  EXPECT_EQ(t.after_forward, r.after_forward + c.num_layers * 2 * rstd);
  EXPECT_EQ(t.host_after_forward, r.host_after_forward - c.num_layers * 2 * rstd);
  EXPECT_EQ(t.after_forward, activation_bytes_model("offload", shape, false, 2048).after_forward);
  expect_bitwise_equal(t, r, "offload with a threshold");
}

TEST(Offload, ParametersStayOnTheDevice) {
  Generator gen(3);
  Tensor w;
  {
    CategoryScope params(MemoryCategory::Parameters);
    w = randn({64, 64}, gen);
  }
  autograd::set_requires_grad(w);
  Tensor x = randn({8, 64}, gen);
  autograd::set_requires_grad(x);
  OffloadHooks hooks;
  reset_activation_counters();
  Tensor y;
  {
    autograd::SavedTensorHooksScope scope = hooks.scope();
    y = ops::linear(x, w);  // saves x (offloaded) and w (a parameter, kept)
  }
  EXPECT_EQ(activation_counters().bytes_offloaded, static_cast<int64_t>(x.nbytes()));
  autograd::backward(y, ones(y.shape()));
  EXPECT_EQ(activation_counters().bytes_restored, static_cast<int64_t>(x.nbytes()));
  // dW = dy^T x with dy = 1: every row of dW is the column sums of x.
  std::vector<float> xv = x.to_float_vector(), gw = autograd::grad(w).to_float_vector();
  for (int j = 0; j < 64; ++j) {
    float col = 0;
    for (int i = 0; i < 8; ++i) col += xv[static_cast<size_t>(i * 64 + j)];
    EXPECT_NEAR(gw[static_cast<size_t>(5 * 64 + j)], col, 1e-4f);
  }
}

TEST(Strategy, UnknownStrategyNamesTheKeyAndTheChoices) {
  auto model = make_model(memory_config(), ops::AttentionImpl::Plain);
  try {
    apply_activation_strategy(*model, {"per_block", nullptr, false, 0});
    FAIL() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("activation.strategy"), std::string::npos) << m;
    EXPECT_NE(m.find("per_block"), std::string::npos) << m;
    EXPECT_NE(m.find("offload_checkpoint"), std::string::npos) << m;
  }
  EXPECT_THROW(
      activation_bytes_per_layer("per_block", 1, 8, 32, 4, 4, 64, 4, ops::AttentionImpl::Plain),
      ConfigError);
}

TEST(Strategy, SqrtSegments) {
  using Segs = std::vector<std::pair<int, int>>;
  EXPECT_EQ(sqrt_segments(4, nullptr), (Segs{{0, 1}, {2, 3}}));
  EXPECT_EQ(sqrt_segments(9, nullptr), (Segs{{0, 2}, {3, 5}, {6, 8}}));
  EXPECT_EQ(sqrt_segments(10, nullptr), (Segs{{0, 2}, {3, 5}, {6, 8}, {9, 9}}));
  EXPECT_EQ(sqrt_segments(1, nullptr), (Segs{{0, 0}}));
  // Layers 2 and 5 not selected: segments never span them.
  EXPECT_EQ(sqrt_segments(7, [](int i) { return i != 2 && i != 5; }),
            (Segs{{0, 1}, {3, 4}, {6, 6}}));
}

TEST(Strategy, LayerSelectionLimitsTheRegions) {
  const nn::LlamaConfig c = memory_config();
  const Batch batch = make_batch(1, 64, c.vocab_size, 17);
  auto reference = make_model(c, ops::AttentionImpl::Plain);
  const StepResult none = run_step(*reference, batch);
  auto model = make_model(c, ops::AttentionImpl::Plain);
  apply_activation_strategy(*model, {"per_layer", [](int l) { return l % 2 == 1; }, false, 0});
  const StepResult r = run_step(*model, batch);
  EXPECT_EQ(r.counters.forward_reruns, 2);
  expect_bitwise_equal(r, none, "per_layer on odd layers");
}

// Nested regions in a real model: each decoder layer a region, and its attention core a region
// inside it. Every region re-runs once; the gradients stay bitwise those of none.
TEST(Checkpoint, NestedRegionsInAModel) {
  const nn::LlamaConfig c = memory_config();
  const Batch batch = make_batch(1, 64, c.vocab_size, 23);
  auto reference = make_model(c, ops::AttentionImpl::Plain);
  const StepResult none = run_step(*reference, batch);
  for (bool reentrant : {false, true}) {
    auto model = make_model(c, ops::AttentionImpl::Plain);
    apply_activation_strategy(*model, {"per_layer", nullptr, reentrant, 0});
    apply_activation_strategy(*model, {"selective", nullptr, reentrant, 0});
    const StepResult r = run_step(*model, batch);
    expect_bitwise_equal(r, none, reentrant ? "nested reentrant" : "nested");
    EXPECT_EQ(r.counters.forward_reruns, 2 * c.num_layers);
  }
}

// ---- checkpoint on plain functions --------------------------------------------------------------

namespace {
Tensor leaf(const Shape& shape, Generator& gen) {
  Tensor t = randn(shape, gen);
  autograd::set_requires_grad(t);
  return t;
}

std::vector<float> grad_of(const Tensor& t) {
  return autograd::grad(t).to_float_vector();
}

void clear_grads(std::vector<Tensor*> ts) {
  for (Tensor* t : ts) autograd::set_grad(*t, Tensor());
}

void expect_same(const std::vector<float>& a, const std::vector<float>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << what;
}
}  // namespace

TEST(Checkpoint, NestedRegionsReRunOnceEach) {
  Generator gen(1);
  Tensor x = leaf({6, 16}, gen), w1 = leaf({16, 16}, gen), w2 = leaf({16, 16}, gen),
         n = leaf({16}, gen);
  TensorFn inner = [&](const Tensor& a) { return ops::swiglu(ops::linear(a, w2), a); };
  auto outer_plain = [&](const Tensor& a) {
    Tensor h = ops::rms_norm(ops::linear(a, w1), n, 1e-5f);
    return ops::linear(inner(h), w1);
  };
  auto outer_nested = [&](const Tensor& a) {
    Tensor h = ops::rms_norm(ops::linear(a, w1), n, 1e-5f);
    return ops::linear(checkpoint(inner, h), w1);
  };
  Tensor seed = randn({6, 16}, gen);
  std::vector<Tensor*> all = {&x, &w1, &w2, &n};

  autograd::backward(outer_plain(x), seed);
  std::vector<std::vector<float>> expected;
  for (Tensor* t : all) expected.push_back(grad_of(*t));

  for (bool reentrant : {false, true}) {
    clear_grads(all);
    reset_activation_counters();
    Tensor y = checkpoint(outer_nested, x, {reentrant, {}});
    EXPECT_EQ(activation_counters().forward_reruns, 0);
    autograd::backward(y, seed);
    // Non-reentrant: the outer region re-runs (its inner region only as far as saving its
    // input), then the inner one. Reentrant: the outer re-run runs the inner region under
    // NoGrad, whose own backward then re-runs it.
    EXPECT_EQ(activation_counters().forward_reruns, 2);
    for (size_t i = 0; i < all.size(); ++i) expect_same(grad_of(*all[i]), expected[i], "nested");
  }
}

TEST(Checkpoint, PartlyUsedOutputs) {
  Generator gen(2);
  Tensor x = leaf({5, 8}, gen), w = leaf({8, 8}, gen), u = leaf({8, 8}, gen);
  // Two outputs; the loss uses only the second (computed first) and rows 1..2 of it.
  TensorsFn fn = [&](const std::vector<Tensor>& a) {
    Tensor used = ops::swiglu(ops::linear(a[0], w), a[0]);
    Tensor unused = ops::mul(ops::linear(a[0], u), a[0]);
    return std::vector<Tensor>{unused, used};
  };
  Tensor seed = randn({2, 8}, gen);
  auto loss_of = [&](const std::vector<Tensor>& outs) { return ops::slice_rows(outs[1], 1, 2); };

  autograd::backward(loss_of(fn({x})), seed);
  std::vector<float> gx = grad_of(x), gw = grad_of(w);
  EXPECT_FALSE(autograd::grad(u).defined());

  for (bool reentrant : {false, true}) {
    clear_grads({&x, &w, &u});
    reset_activation_counters();
    std::vector<Tensor> outs = checkpoint_multi(fn, {x}, {reentrant, {}});
    autograd::backward(loss_of(outs), seed);
    EXPECT_EQ(activation_counters().forward_reruns, 1);
    expect_same(grad_of(x), gx, "x");
    expect_same(grad_of(w), gw, "w");
    if (reentrant) {
      // The whole region runs backward, the unused output with a zero gradient.
      ASSERT_TRUE(autograd::grad(u).defined());
      for (float g : grad_of(u)) EXPECT_EQ(g, 0.0f);
    } else {
      EXPECT_FALSE(autograd::grad(u).defined()) << "the unused output's graph must not run";
    }
  }
}

TEST(Checkpoint, ReplaysRandomness) {
  Generator data(3);
  Tensor x = leaf({4, 8}, data), w = leaf({8, 8}, data);
  Generator noise(77);
  auto fn = [&](const Tensor& a) {
    Tensor mask = rand_uniform({4, 8}, noise, 0.0f, 2.0f);  // a dropout-like random factor
    return ops::mul(ops::linear(a, w), mask);
  };
  Tensor seed = randn({4, 8}, data);

  RngState start = snapshot_rng(noise);
  autograd::backward(fn(x), seed);
  std::vector<float> gx = grad_of(x), gw = grad_of(w);
  RngState after_plain = snapshot_rng(noise);

  restore_rng(noise, start);
  clear_grads({&x, &w});
  Tensor y = checkpoint(fn, x, {false, {&noise}});
  autograd::backward(y, seed);
  expect_same(grad_of(x), gx, "x with the generator replayed");
  expect_same(grad_of(w), gw, "w with the generator replayed");
  // The re-run put the generator back where the forward left it.
  EXPECT_EQ(snapshot_rng(noise).offset, after_plain.offset);

  // Without the generator listed the re-run draws new numbers: w's gradient changes.
  restore_rng(noise, start);
  clear_grads({&x, &w});
  Tensor z = checkpoint(fn, x);
  autograd::backward(z, seed);
  std::vector<float> other = grad_of(w);
  EXPECT_NE(std::memcmp(other.data(), gw.data(), gw.size() * sizeof(float)), 0);
}

TEST(Checkpoint, ReentrantInputWithoutGradientStillReachesParameters) {
  Generator gen(4);
  Tensor x = randn({3, 8}, gen), w = leaf({8, 8}, gen);
  auto fn = [&](const Tensor& a) { return ops::linear(a, w); };
  Tensor seed = randn({3, 8}, gen);
  autograd::backward(fn(x), seed);
  std::vector<float> gw = grad_of(w);
  for (bool reentrant : {false, true}) {
    clear_grads({&w});
    autograd::backward(checkpoint(fn, x, {reentrant, {}}), seed);
    expect_same(grad_of(w), gw, reentrant ? "reentrant" : "non-reentrant");
  }
}

TEST(Checkpoint, NonDeterministicRegionIsReported) {
  for (bool reentrant : {false, true}) {
    SCOPED_TRACE(reentrant ? "reentrant" : "non-reentrant");
    Generator gen(5);
    Tensor x = leaf({3, 8}, gen), w = leaf({8, 8}, gen);
    int calls = 0;
    auto fn = [&](const Tensor& a) {
      // The re-run takes a different path, saving (and returning) a differently shaped tensor.
      Tensor in = ++calls == 1 ? a : ops::slice_rows(a, 0, 2);
      return ops::linear(in, w);
    };
    CheckpointOptions options;
    options.reentrant = reentrant;
    Tensor y = checkpoint(fn, x, options);
    try {
      autograd::backward(y, ones(y.shape()));
      FAIL() << "expected an error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("not deterministic"), std::string::npos) << e.what();
    }
  }
}

TEST(Checkpoint, OutsideGradModeJustRuns) {
  Generator gen(6);
  Tensor x = leaf({3, 8}, gen), w = leaf({8, 8}, gen);
  autograd::NoGrad no_grad;
  reset_activation_counters();
  Tensor y = checkpoint([&](const Tensor& a) { return ops::linear(a, w); }, x);
  EXPECT_FALSE(autograd::requires_grad(y));
  std::vector<float> expected = ops::linear(x, w).to_float_vector();
  expect_same(y.to_float_vector(), expected, "no-grad checkpoint output");
}

// ---- the formulas by hand -----------------------------------------------------------------------

TEST(Estimate, PerLayerBytesByHand) {
  // B=1, S=256, hidden 32, 4 heads (head dim 8), 2 kv heads, intermediate 64, f32:
  // X = 256*32*4 = 32768, KV = 256*16*4 = 16384, M = 65536, rstd = 1024, P = 4*256*256*4.
  const int64_t X = 32768, KV = 16384, M = 65536, R = 1024, P = 1048576, LSE = 4096;
  auto bytes = [](const char* s, ops::AttentionImpl impl) {
    return activation_bytes_per_layer(s, 1, 256, 32, 4, 2, 64, 4, impl);
  };
  const auto plain = ops::AttentionImpl::Plain, fused = ops::AttentionImpl::Fused;
  EXPECT_EQ(bytes("none", plain), 6 * X + 2 * KV + 3 * M + 2 * R + P);
  EXPECT_EQ(bytes("none", fused), 7 * X + 2 * KV + 3 * M + 2 * R + LSE);
  EXPECT_EQ(bytes("selective", plain), 6 * X + 2 * KV + 3 * M + 2 * R);
  EXPECT_EQ(bytes("selective", fused), 6 * X + 2 * KV + 3 * M + 2 * R);
  EXPECT_EQ(bytes("per_layer", plain), X);
  EXPECT_EQ(bytes("sqrt_segment", plain), X);
  EXPECT_EQ(bytes("offload", plain), 0);
  EXPECT_EQ(bytes("offload_checkpoint", plain), 0);
  EXPECT_EQ(activation_bytes_per_layer("offload", 1, 256, 32, 4, 2, 64, 4, plain, 2048), 2 * R);
}
