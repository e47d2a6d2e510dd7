// The autograd engine: exact memory behaviour per category, saved-tensor hooks, gradient hooks.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <optional>

#include "shardtrain/autograd/engine.h"
#include "shardtrain/autograd/grad_mode.h"
#include "shardtrain/autograd/saved_tensor.h"
#include "shardtrain/backend/backend.h"
#include "shardtrain/ops/ops.h"

using namespace shardtrain;

namespace {

int64_t in_use(Device d, MemoryCategory c) {
  return allocator_for(d).stats().in_use_of(c);
}

struct TwoLayer {
  Tensor w1, w2;
  explicit TwoLayer(uint64_t seed) {
    Generator gen(seed);
    CategoryScope scope(MemoryCategory::Parameters);
    w1 = randn({16, 8}, gen);  // 512 bytes
    w2 = randn({8, 16}, gen);  // 512 bytes
    autograd::set_requires_grad(w1);
    autograd::set_requires_grad(w2);
  }
  // y = linear(h * h, w2) with h = linear(x, w1); x [4, 8] 128 B, h and h*h [4, 16] 256 B each.
  Tensor forward(const Tensor& x) const {
    Tensor h = ops::linear(x, w1);
    return ops::linear(ops::mul(h, h), w2);
  }
};

Tensor input(uint64_t seed) {
  Generator gen(seed);
  return randn({4, 8}, gen);
}

}  // namespace

TEST(Autograd, ExactBytesPerCategoryThroughForwardAndBackward) {
  const Device cpu = Device::cpu();
  TwoLayer model(1);
  Allocator& a = allocator_for(cpu);
  MemoryStats base = a.stats();
  Tensor x = input(2);
  Tensor y = model.forward(x);
  // After forward: x, h, h*h (saved) and y are alive.
  EXPECT_EQ(in_use(cpu, MemoryCategory::Activations) - base.in_use_of(MemoryCategory::Activations),
            128 + 256 + 256 + 128);
  Tensor seed;
  {
    CategoryScope ws(MemoryCategory::Workspace);
    seed = ones({4, 8});
  }
  a.reset_peak();
  MemoryStats before = a.stats();
  autograd::backward(y, seed);
  MemoryStats after = a.stats();
  auto delta = [&](MemoryCategory c) { return after.in_use_of(c) - before.in_use_of(c); };
  // Saved tensors are freed as their nodes run: only x and y (held here) remain.
  EXPECT_EQ(delta(MemoryCategory::Activations), -(256 + 256));
  // The two weight gradients, and nothing else, are left as Gradients.
  EXPECT_EQ(delta(MemoryCategory::Gradients), 512 + 512);
  EXPECT_EQ(delta(MemoryCategory::Workspace), 0);
  // The peak is inside MulBackward: its two input gradients da, db (256 each) exist next to its
  // incoming gradient dx (256) and the seed (128): Workspace 896; h*h is already freed
  // (Activations: x, h, y = 512) and dW2 already accumulated (Gradients 512). Before backward:
  // Activations 768 + Workspace 128.
  int64_t peak_rise = after.total_peak - before.total_in_use;
  EXPECT_EQ(peak_rise, (512 + 896 + 512) - (768 + 128));
  EXPECT_EQ(after.at_peak[static_cast<int>(MemoryCategory::Workspace)] -
                before.in_use_of(MemoryCategory::Workspace),
            896 - 128);
  EXPECT_EQ(autograd::last_backward_stats().nodes_run, 5);  // 2 linear, mul, 2 accumulators
}

TEST(Autograd, PackHookToHostFreesDeviceActivationsAndKeepsGradientsBitwise) {
  auto run = [](bool offload) {
    TwoLayer model(3);
    int64_t act0 = in_use(Device::cpu(), MemoryCategory::Activations);
    int64_t host0 = in_use(Device::host(), MemoryCategory::Offloaded);
    Tensor y;
    int pack_calls = 0, unpack_calls = 0;
    {
      std::optional<autograd::SavedTensorHooksScope> scope;
      if (offload) {
        scope.emplace(autograd::SavedTensorHooks{
            [&](const Tensor& t) -> std::any {
              ++pack_calls;
              if (t.category() == MemoryCategory::Parameters) return t;  // keep weights
              return t.to(Device::host(), MemoryCategory::Offloaded);
            },
            [&](std::any& packed) {
              ++unpack_calls;
              Tensor t = std::any_cast<Tensor>(packed);
              return t.device().is_host() ? t.to(Device::cpu(), MemoryCategory::Activations) : t;
            }});
      }
      y = model.forward(input(4));
    }
    int64_t act_after_forward = in_use(Device::cpu(), MemoryCategory::Activations) - act0;
    int64_t host_after_forward = in_use(Device::host(), MemoryCategory::Offloaded) - host0;
    autograd::backward(y, ones({4, 8}));
    std::vector<float> g1 = autograd::grad(model.w1).to_float_vector();
    std::vector<float> g2 = autograd::grad(model.w2).to_float_vector();
    g1.insert(g1.end(), g2.begin(), g2.end());
    int64_t host_after_backward = in_use(Device::host(), MemoryCategory::Offloaded) - host0;
    return std::tuple{g1,         act_after_forward, host_after_forward, host_after_backward,
                      pack_calls, unpack_calls};
  };
  auto [plain, plain_act, plain_host, plain_host_bw, p0, u0] = run(false);
  auto [hooked, hooked_act, hooked_host, hooked_host_bw, p1, u1] = run(true);
  // Without hooks x, h and h*h stay on the device; with them only y (128 B) does.
  EXPECT_EQ(plain_act, 128 + 256 + 256 + 128);
  EXPECT_EQ(hooked_act, 128);
  EXPECT_EQ(plain_host, 0);
  // x, h twice (mul saves both of its operands and this hook copies each), h*h.
  EXPECT_EQ(hooked_host, 128 + 256 + 256 + 256);
  EXPECT_EQ(hooked_host_bw, 0);  // released as nodes ran
  EXPECT_EQ(p0, 0);
  EXPECT_EQ(p1, 6);  // linear: x, w1; mul: h, h; linear: h*h, w2
  EXPECT_EQ(u1, 6);
  ASSERT_EQ(plain.size(), hooked.size());
  EXPECT_EQ(std::memcmp(plain.data(), hooked.data(), plain.size() * sizeof(float)), 0);
}

TEST(Autograd, DisabledHooksScopeHidesOuterHooks) {
  int packs = 0;
  autograd::SavedTensorHooksScope outer(
      autograd::SavedTensorHooks{[&](const Tensor& t) -> std::any {
                                   ++packs;
                                   return t;
                                 },
                                 [](std::any& p) { return std::any_cast<Tensor>(p); }});
  TwoLayer model(5);
  {
    auto hidden = autograd::SavedTensorHooksScope::disabled();
    model.forward(input(6));
  }
  EXPECT_EQ(packs, 0);
  model.forward(input(6));
  EXPECT_EQ(packs, 6);
}

TEST(Autograd, GradientHooksAndPostAccumulateHooks) {
  TwoLayer model(7);
  Tensor x = input(8);
  x = x.clone();
  autograd::set_requires_grad(x);
  Tensor h = ops::linear(x, model.w1);
  int seen = 0;
  autograd::register_hook(h, [&](const Tensor& g) {
    ++seen;
    Tensor doubled = empty(g.shape());
    backend_for(g.device()).scale(g, doubled, 2.0f);
    return doubled;
  });
  int accumulated = 0;
  autograd::register_post_accumulate_grad_hook(model.w1, [&](Tensor& leaf) {
    ++accumulated;
    EXPECT_TRUE(autograd::grad(leaf).defined());
  });
  Tensor y = ops::linear(h, model.w2);
  autograd::backward(y, ones({4, 8}));
  EXPECT_EQ(seen, 1);
  EXPECT_EQ(accumulated, 1);
  // d/dx of linear(linear(x, w1), w2) with the doubled middle gradient: 2 * 1 @ w2 @ w1.
  std::vector<float> w1 = model.w1.to_float_vector(), w2 = model.w2.to_float_vector();
  std::vector<float> gx = autograd::grad(x).to_float_vector();
  for (int j = 0; j < 8; ++j) {
    double want = 0;
    for (int m = 0; m < 16; ++m) {
      double s = 0;
      for (int o = 0; o < 8; ++o) s += w2[static_cast<size_t>(o * 16 + m)];
      want += s * w1[static_cast<size_t>(m * 8 + j)];
    }
    EXPECT_NEAR(gx[static_cast<size_t>(j)], 2 * want, 1e-4);
  }
}

TEST(Autograd, AccumulatesAcrossBackwardCallsAndErrorsClearly) {
  TwoLayer model(9);
  autograd::backward(model.forward(input(10)), ones({4, 8}));
  std::vector<float> once = autograd::grad(model.w1).to_float_vector();
  autograd::backward(model.forward(input(10)), ones({4, 8}));
  std::vector<float> twice = autograd::grad(model.w1).to_float_vector();
  for (size_t i = 0; i < once.size(); ++i) EXPECT_FLOAT_EQ(twice[i], 2 * once[i]);

  Tensor plain = input(11);
  try {
    autograd::backward(plain);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not require a gradient"), std::string::npos);
  }
  Tensor y;
  {
    autograd::NoGrad ng;
    y = model.forward(input(12));
  }
  EXPECT_FALSE(autograd::requires_grad(y));
}

// A gradient of the wrong shape or dtype (given for the root, or returned by a hook) is refused
// where it enters: the kernels size their loops from the tensor and would read past its end.
TEST(Autograd, GradientsOfAnotherShapeOrDtypeAreRefused) {
  auto expect_shape_error = [](const std::function<void()>& fn, const std::string& part) {
    try {
      fn();
      ADD_FAILURE() << "no ShapeError";
    } catch (const ShapeError& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  TwoLayer model(15);
  expect_shape_error([&] { autograd::backward(model.forward(input(16)), ones({2})); },
                     "the gradient given for the root is");
  expect_shape_error(
      [&] {
        autograd::backward(model.forward(input(16)), ones({4, 8}, DType::BF16));
      },
      "the gradient given for the root is");
  {
    Tensor h = ops::linear(input(17), model.w1);
    autograd::register_hook(h, [](const Tensor&) { return ones({1}); });
    Tensor y = ops::linear(h, model.w2);
    expect_shape_error(
        [&] {
          autograd::backward(y, ones({4, 8}));
        },
        "the gradient of an output is");
  }
  {
    Tensor leaf = input(18).clone();
    autograd::set_requires_grad(leaf);
    autograd::register_hook(leaf, [](const Tensor&) { return ones({3}); });
    Tensor y = ops::linear(leaf, model.w1);
    expect_shape_error([&] { autograd::backward(y, ones({4, 16})); }, "the gradient of a leaf is");
  }
}

TEST(Autograd, OutOfMemoryLeavesTheGraphUsable) {
  TwoLayer model(13);
  Allocator& a = allocator_for(Device::cpu());
  int64_t used = a.stats().total_in_use;
  a.set_capacity(used + 300);  // room for x and h, not for h*h and y
  Tensor x = input(14);
  EXPECT_THROW(model.forward(x), OutOfMemoryError);
  a.set_capacity(0);
  EXPECT_EQ(a.stats().total_in_use, used + 128);  // only x: the failed forward freed everything
  autograd::backward(model.forward(x), ones({4, 8}));
  EXPECT_TRUE(autograd::grad(model.w2).defined());
}
