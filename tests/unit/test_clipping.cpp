// Global-norm clipping and loss-scale unscaling in a training step. Runtime::train_step hands the
// clipping factor, times the reciprocal of the fp16 loss scale, to the optimizer, which applies it
// inside its update, instead of unscaling and then clipping every gradient in passes of their own
// first. The step must still be the classic one (unscale in place, norm, gradients clipped in
// place, plain step), bit for bit with fp32 gradients and the default power-of-two loss scale, for
// each optimizer, and a different step from the unclipped one; an overflow must still skip it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "offload_optimizer.h"
#include "shardtrain/autograd/node.h"
#include "shardtrain/optim/optimizer.h"
#include "shardtrain/train/runtime.h"

using namespace shardtrain;
using shardtrain::testing::golden_batch;
using shardtrain::testing::kGoldenModelDir;

namespace {

constexpr float kLr = 1e-2f;

// Optimizer sets ("" = on-device AdamW) and the compute dtype (fp16: dynamic loss scaling).
using Case = std::tuple<std::string, std::string>;

train::Config config_with(const Case& c, double max_norm, const std::string& extra = "") {
  const auto& [optimizer_sets, compute] = c;
  std::vector<std::string> sets = {"train.device=cpu", "model.from_hf=" + kGoldenModelDir,
                                   "optim.grad_clip=" + std::to_string(max_norm),
                                   "precision.compute=" + compute};
  if (!optimizer_sets.empty()) sets.push_back(optimizer_sets);
  if (!extra.empty()) sets.push_back(extra);
  return train::Config::parse("{}", sets, "clipping");
}

std::string optimizer_name(const std::string& sets) {
  if (sets.empty()) return "adamw";
  return sets == "optim.offload=cpu" ? "offloaded_adamw" : "sgd";
}

// The trainable weights' bit patterns (-0.0 against 0.0 and NaN payloads count as differences).
std::vector<std::vector<uint32_t>> weights(train::Runtime& rt) {
  std::vector<std::vector<uint32_t>> out;
  for (const optim::NamedParam& p : rt.trainable())
    out.push_back(shardtrain::testing::bits_of(*p.param));
  return out;
}

class Clipping : public ::testing::TestWithParam<Case> {};

TEST_P(Clipping, TrainStepIsTheStepOnGradientsUnscaledAndClippedInPlace) {
  const double max_norm = 0.05;
  const std::vector<Batch> batch = golden_batch();
  train::Runtime fused(config_with(GetParam(), max_norm));
  ASSERT_EQ(fused.scaler().enabled(), std::get<1>(GetParam()) == "fp16")
      << "the premise: fp16 runs scale the loss";
  const train::StepResult r = fused.train_step(batch, kLr);
  ASSERT_FALSE(r.skipped);

  // The classic order, by hand: gradients unscaled in place (forward_backward), the norm, the
  // gradients clipped in place, a plain step.
  train::Runtime classic(config_with(GetParam(), max_norm));
  classic.optimizer().zero_grad();
  ASSERT_FALSE(classic.forward_backward(batch).found_inf);
  const std::vector<optim::NamedParam> params = classic.trainable();
  const double norm = optim::clip_grad_norm(params, max_norm);
  classic.optimizer().step(kLr);

  ASSERT_GT(norm, 2 * max_norm) << "the premise: this step is clipped";
  EXPECT_EQ(r.grad_norm, norm);
  EXPECT_EQ(weights(fused), weights(classic));

  // Without clipping the step is another one (the factor is not silently dropped).
  train::Runtime unclipped(config_with(GetParam(), 0.0));
  const train::StepResult u = unclipped.train_step(batch, kLr);
  EXPECT_EQ(u.grad_norm, norm);
  EXPECT_NE(weights(unclipped), weights(fused));
}

// An overflow in the scaled fp16 backward skips the step: the weights and the optimizer stay as
// they were, the norm is reported as infinite and the scale backs off.
class Fp16Overflow : public ::testing::TestWithParam<std::string> {};

TEST_P(Fp16Overflow, SkipsTheStep) {
  // 2^40 overflows the fp16 gradients of the first backward.
  train::Runtime rt(config_with({GetParam(), "fp16"}, 1.0, "precision.init_scale=1099511627776"));
  const std::vector<std::vector<uint32_t>> before = weights(rt);
  const float scale = rt.scaler().scale();
  const train::StepResult r = rt.train_step(golden_batch(), kLr);
  EXPECT_TRUE(r.skipped);
  EXPECT_TRUE(std::isinf(r.grad_norm));
  EXPECT_EQ(weights(rt), before);
  EXPECT_EQ(rt.optimizer().steps_taken(), 0);
  EXPECT_EQ(rt.scaler().skipped_steps(), 1);
  EXPECT_EQ(rt.scaler().scale(), scale * 0.5f);

  // The backed-off scale keeps overflowing until it is small enough; a clean step then runs.
  bool stepped = false;
  for (int i = 0; i < 30 && !stepped; ++i) stepped = !rt.train_step(golden_batch(), kLr).skipped;
  EXPECT_TRUE(stepped);
  EXPECT_EQ(rt.optimizer().steps_taken(), 1);
  EXPECT_NE(weights(rt), before);
}

// Without loss scaling nothing skips a step whose gradients hold inf or nan: train_step stops with
// an error instead, before the update writes nan into every weight.
class NonFiniteGradient : public ::testing::TestWithParam<Case> {};

TEST_P(NonFiniteGradient, StopsTheStepWithoutLossScaling) {
  train::Runtime rt(config_with(GetParam(), 1.0, "precision.loss_scale=none"));
  ASSERT_FALSE(rt.scaler().enabled());
  const std::vector<std::vector<uint32_t>> before = weights(rt);
  // One weight's gradient turns nan on its way into .grad: the loss stays finite.
  Tensor& victim = *rt.trainable().front().param;
  autograd::register_hook(
      victim, [](const Tensor& g) { return full(g.shape(), NAN, g.dtype(), g.device()); });
  try {
    rt.train_step(golden_batch(), kLr);
    ADD_FAILURE() << "a step with a nan gradient went ahead";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("inf or nan"), std::string::npos) << message;
    EXPECT_NE(message.find("not updated"), std::string::npos) << message;
    // Before any update the learning rate cannot be the cause.
    EXPECT_NE(message.find("so the learning rate is not the cause: check the initial weights"),
              std::string::npos)
        << message;
  }
  EXPECT_EQ(weights(rt), before);
  EXPECT_EQ(rt.optimizer().steps_taken(), 0);

  // After an update it may be.
  train::Runtime later(config_with(GetParam(), 1.0, "precision.loss_scale=none"));
  later.train_step(golden_batch(), kLr);
  autograd::register_hook(*later.trainable().front().param, [](const Tensor& g) {
    return full(g.shape(), NAN, g.dtype(), g.device());
  });
  try {
    later.train_step(golden_batch(), kLr);
    ADD_FAILURE() << "a step with a nan gradient went ahead";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("Lower optim.lr or lengthen optim.warmup_steps"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(later.optimizer().steps_taken(), 1);
}

INSTANTIATE_TEST_SUITE_P(Optimizers, Clipping,
                         ::testing::Combine(::testing::Values("", "optim.offload=cpu",
                                                              "optim.name=sgd"),
                                            ::testing::Values("fp32", "fp16")),
                         [](const auto& info) -> std::string {
                           return optimizer_name(std::get<0>(info.param)) + "_" +
                                  std::get<1>(info.param);
                         });

INSTANTIATE_TEST_SUITE_P(Optimizers, Fp16Overflow,
                         ::testing::Values("", "optim.offload=cpu", "optim.name=sgd"),
                         [](const auto& info) -> std::string {
                           return optimizer_name(info.param);
                         });

INSTANTIATE_TEST_SUITE_P(OptimizersAndPrecisions, NonFiniteGradient,
                         ::testing::Combine(::testing::Values("", "optim.offload=cpu",
                                                              "optim.name=sgd"),
                                            ::testing::Values("fp32", "bf16", "fp16")),
                         [](const auto& info) -> std::string {
                           return optimizer_name(std::get<0>(info.param)) + "_" +
                                  std::get<1>(info.param);
                         });

}  // namespace
