// Weight decay of the two optimizers, against the update written out by hand: which parameters
// decay (projections by default, every parameter with decay_all) and how (AdamW decoupled from
// the gradient, SGD as torch.optim.SGD: L2 added to the gradient before the momentum).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "shardtrain/autograd/node.h"
#include "shardtrain/optim/optimizer.h"

namespace shardtrain {
namespace {

constexpr double kLr = 0.1, kDecay = 0.1, kGrad = 0.5, kStart = 1.0;

// A projection (decayed by default), a norm gain and an embedding (not decayed by default), each
// of 3 elements equal to kStart.
struct Params {
  std::vector<std::string> names = {"layers.0.self_attn.q_proj.weight",
                                    "layers.0.input_layernorm.weight", "embed_tokens.weight"};
  std::vector<Tensor> tensors;
  Params() {
    for (size_t i = 0; i < names.size(); ++i) {
      tensors.push_back(full({3}, static_cast<float>(kStart)));
      autograd::set_requires_grad(tensors.back());
    }
  }
  std::vector<optim::NamedParam> named() {
    std::vector<optim::NamedParam> out;
    for (size_t i = 0; i < names.size(); ++i) out.push_back({names[i], &tensors[i]});
    return out;
  }
  void set_grads() {
    for (Tensor& t : tensors) autograd::set_grad(t, full({3}, static_cast<float>(kGrad)));
  }
};

void expect_all(const Tensor& t, double want, const std::string& name) {
  for (float v : t.to_float_vector()) EXPECT_NEAR(v, want, 1e-6) << name;
}

TEST(WeightDecay, SgdAddsL2ToTheGradientOfTheChosenParametersBeforeTheMomentum) {
  for (bool decay_all : {false, true}) {
    SCOPED_TRACE("decay_all=" + std::to_string(decay_all));
    Params p;
    optim::SGD sgd(p.named(), 0.9f, static_cast<float>(kDecay), decay_all);
    for (int step = 0; step < 2; ++step) {
      p.set_grads();
      sgd.step(static_cast<float>(kLr));
    }
    // Two steps by hand: d = g + wd p; buf = d, then 0.9 buf + d; p -= lr buf.
    auto two_steps = [](double wd) {
      double w = kStart;
      double buf = kGrad + wd * w;
      w -= kLr * buf;
      buf = 0.9 * buf + (kGrad + wd * w);
      return w - kLr * buf;
    };
    expect_all(p.tensors[0], two_steps(kDecay), p.names[0]);
    for (size_t i : {1, 2}) expect_all(p.tensors[i], two_steps(decay_all ? kDecay : 0), p.names[i]);
  }
}

TEST(WeightDecay, AdamWDecaysTheChosenParametersApartFromTheGradient) {
  for (bool decay_all : {false, true}) {
    SCOPED_TRACE("decay_all=" + std::to_string(decay_all));
    Params p;
    optim::AdamWOptions options;
    options.weight_decay = static_cast<float>(kDecay);
    options.decay_all = decay_all;
    optim::AdamW adamw(p.named(), options);
    p.set_grads();
    adamw.step(static_cast<float>(kLr));
    // First step: the bias-corrected moments are g and g^2, so the gradient moves each weight by
    // lr g / (|g| + eps); decay multiplies the weight by 1 - lr wd, whatever the gradient.
    auto one_step = [](double wd) {
      return kStart * (1 - kLr * wd) - kLr * kGrad / (kGrad + 1e-8);
    };
    expect_all(p.tensors[0], one_step(kDecay), p.names[0]);
    for (size_t i : {1, 2}) expect_all(p.tensors[i], one_step(decay_all ? kDecay : 0), p.names[i]);
  }
}

// The schedule against numbers worked by hand: peak 1, min_lr 0.1, 4 warm-up steps of 12. Warm-up
// reaches the peak at its last step (step + 1 of 4); the decay runs over the 8 steps after it, a
// quarter of the way at step 6 and half-way at step 8, and stays at min_lr from step 12 on.
TEST(LrSchedule, FollowsWarmupThenDecaysToMinLrAndStaysThere) {
  using Kind = optim::LrSchedule::Kind;
  for (const Kind kind : {Kind::Cosine, Kind::Linear, Kind::Constant}) {
    SCOPED_TRACE(static_cast<int>(kind));
    optim::LrSchedule s;
    s.kind = kind;
    s.peak = 1.0f;
    s.min_lr = 0.1f;
    s.warmup_steps = 4;
    s.total_steps = 12;
    EXPECT_FLOAT_EQ(s.at(0), 0.25f);
    EXPECT_FLOAT_EQ(s.at(1), 0.5f);
    EXPECT_FLOAT_EQ(s.at(3), 1.0f);
    EXPECT_FLOAT_EQ(s.at(4), 1.0f);  // the first decay step is at the peak
    if (kind == Kind::Constant) {
      for (int64_t step : {5, 8, 12, 40}) EXPECT_FLOAT_EQ(s.at(step), 1.0f);
      continue;
    }
    // A quarter of the way: cosine 0.1 + 0.9 * (1 + cos(pi/4)) / 2, linear 0.1 + 0.9 * 0.75.
    EXPECT_FLOAT_EQ(s.at(6), kind == Kind::Cosine ? 0.86819805f : 0.775f);
    EXPECT_FLOAT_EQ(s.at(8), 0.55f);  // half-way: cosine and linear agree there
    EXPECT_FLOAT_EQ(s.at(12), 0.1f);
    EXPECT_FLOAT_EQ(s.at(20), 0.1f);  // past the end: min_lr, never below
  }
}

}  // namespace
}  // namespace shardtrain
