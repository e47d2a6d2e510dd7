#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "shardtrain/amp/grad_scaler.h"
#include "shardtrain/amp/mixed_precision.h"
#include "shardtrain/autograd/engine.h"
#include "shardtrain/autograd/node.h"

using namespace shardtrain;

namespace {
nn::LlamaConfig small_config() {
  nn::LlamaConfig c;
  c.vocab_size = 256;
  c.hidden_size = 64;
  c.intermediate_size = 176;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.max_seq_len = 64;
  return c;
}

struct Batch {
  Tensor ids, targets;
};
Batch make_batch(int64_t b, int64_t s, uint64_t seed) {
  Generator gen(seed);
  std::vector<float> u(static_cast<size_t>(b * s * 2));
  gen.uniform(u.data(), static_cast<int64_t>(u.size()));
  std::vector<int64_t> ids, targets;
  for (int64_t i = 0; i < b * s; ++i) {
    ids.push_back(static_cast<int64_t>(u[i] * 256) % 256);
    targets.push_back(static_cast<int64_t>(u[b * s + i] * 256) % 256);
  }
  targets[3] = -100;
  targets[7] = -100;
  return {from_ints(ids, {b, s}), from_ints(targets, {b, s})};
}

struct Measured {
  double loss_per_token;
  int64_t peak_act;
  int64_t params_after_forward;
};

Measured run(DType dt, ops::AttentionImpl impl, int64_t b, int64_t s) {
  nn::LlamaModel model(small_config(), Device::cpu());
  model.init_weights(1);
  model.set_attention_impl(impl);
  amp::install_mixed_precision(model, {dt, DType::F32});
  Batch batch = make_batch(b, s, 3);
  Allocator& a = allocator_for(Device::cpu());
  a.reset_peak();
  int64_t base = a.stats().in_use_of(MemoryCategory::Activations);
  int64_t pbase = a.stats().in_use_of(MemoryCategory::Parameters);
  int64_t count = 0;
  Tensor loss = model.loss_sum(batch.ids, batch.targets, &count);
  int64_t pafter = a.stats().in_use_of(MemoryCategory::Parameters) - pbase;
  autograd::backward(loss);
  int64_t peak = a.stats().peak_of(MemoryCategory::Activations) - base;
  return {loss.item() / count, peak, pafter};
}
}  // namespace

TEST(Explore, Numbers) {
  for (auto impl : {ops::AttentionImpl::Plain, ops::AttentionImpl::Fused}) {
    for (auto [b, s] : {std::pair<int64_t, int64_t>{2, 16}, {2, 32}, {4, 64}}) {
      Measured f = run(DType::F32, impl, b, s);
      Measured h = run(DType::BF16, impl, b, s);
      Measured g = run(DType::F16, impl, b, s);
      std::printf("impl %d b %ld s %ld: f32 %.6f peak %ld p %ld | bf16 %.6f peak %ld p %ld | f16 %.6f peak %ld\n",
                  (int)impl, b, s, f.loss_per_token, f.peak_act, f.params_after_forward,
                  h.loss_per_token, h.peak_act, h.params_after_forward, g.loss_per_token,
                  g.peak_act);
    }
  }
}
