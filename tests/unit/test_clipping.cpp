// Global-norm clipping in a training step. Runtime::train_step hands the clipping factor to the
// optimizer, which applies it inside its update, instead of scaling every gradient in a pass of its
// own first. The step must still be the classic one (norm, gradients scaled in place, plain step),
// bit for bit with fp32 gradients, for each optimizer, and a different step from the unclipped one.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "offload_optimizer.h"
#include "shardtrain/optim/optimizer.h"
#include "shardtrain/train/runtime.h"

using namespace shardtrain;
using shardtrain::testing::golden_batch;
using shardtrain::testing::kGoldenModelDir;

namespace {

constexpr float kLr = 1e-2f;

train::Config config_with(const std::string& optimizer_sets, double max_norm) {
  std::vector<std::string> sets = {"train.device=cpu", "model.from_hf=" + kGoldenModelDir,
                                   "optim.grad_clip=" + std::to_string(max_norm)};
  if (!optimizer_sets.empty()) sets.push_back(optimizer_sets);
  return train::Config::parse("{}", sets, "clipping");
}

// The trainable weights' bit patterns (-0.0 against 0.0 and NaN payloads count as differences).
std::vector<std::vector<uint32_t>> weights(train::Runtime& rt) {
  std::vector<std::vector<uint32_t>> out;
  for (const optim::NamedParam& p : rt.trainable())
    out.push_back(shardtrain::testing::bits_of(*p.param));
  return out;
}

class Clipping : public ::testing::TestWithParam<std::string> {};

TEST_P(Clipping, TrainStepIsTheStepOnGradientsScaledInPlace) {
  const double max_norm = 0.05;
  const std::vector<Batch> batch = golden_batch();

  train::Runtime fused(config_with(GetParam(), max_norm));
  const train::StepResult r = fused.train_step(batch, kLr);

  // The classic order, by hand: the norm, the gradients scaled in place, an unscaled step.
  train::Runtime classic(config_with(GetParam(), max_norm));
  classic.optimizer().zero_grad();
  classic.forward_backward(batch);
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

INSTANTIATE_TEST_SUITE_P(Optimizers, Clipping,
                         ::testing::Values("", "optim.offload=cpu", "optim.name=sgd"),
                         [](const auto& info) -> std::string {
                           if (info.param.empty()) return "adamw";
                           return info.param == "optim.offload=cpu" ? "offloaded_adamw" : "sgd";
                         });

}  // namespace
