// Gradient accumulation normalises by the tokens of the whole global batch. On the reference
// batch (two sequences with unevenly spread ignored targets) that reproduces the reference
// gradients; averaging per-micro-batch means, the common mistake, does not.
#include <gtest/gtest.h>

#include <cmath>

#include "shardtrain/autograd/engine.h"
#include "shardtrain/autograd/node.h"
#include "shardtrain/io/safetensors.h"
#include "shardtrain/ops/ops.h"
#include "shardtrain/train/runtime.h"

using namespace shardtrain;

namespace {
const std::string kGolden = std::string(SHARDTRAIN_TEST_DATA) + "/golden/llama-tiny-gqa";

// Relative L2 distance between our gradients and the reference's, over every parameter.
double gradient_error(train::Runtime& rt, const SafetensorsFile& expected) {
  double err = 0, ref = 0;
  for (auto& [name, slot] : rt.model().named_parameters()) {
    std::vector<float> got = autograd::grad(*slot).to_float_vector();
    std::vector<float> want = expected.load("grad." + name).to_float_vector();
    for (size_t i = 0; i < want.size(); ++i) {
      err += (static_cast<double>(got[i]) - want[i]) * (static_cast<double>(got[i]) - want[i]);
      ref += static_cast<double>(want[i]) * want[i];
    }
  }
  return std::sqrt(err / ref);
}
}  // namespace

TEST(Accumulation, TokenWeightedMatchesAndPerMicroBatchMeansDoNot) {
  SafetensorsFile batch_file = SafetensorsFile::open(kGolden + "/batch.safetensors");
  SafetensorsFile expected = SafetensorsFile::open(kGolden + "/expected.safetensors");
  Batch full;
  full.input_ids = batch_file.load("input_ids");
  full.targets = batch_file.load("targets");
  full.num_target_tokens = count_target_tokens(full.targets);
  std::vector<Batch> micro = split_batch(full, 2);
  ASSERT_EQ(micro.size(), 2u);
  // The premise: the two sequences count different numbers of targets.
  ASSERT_NE(micro[0].num_target_tokens, micro[1].num_target_tokens);

  train::Config config = train::Config::parse("{}", {"train.device=cpu"}, "test");
  config.model.from_hf = kGolden;

  {  // What the trainer does: every micro-batch divided by the global batch's token count.
    train::Runtime rt(config);
    rt.optimizer().zero_grad();
    rt.forward_backward(micro);
    EXPECT_LT(gradient_error(rt, expected), 1e-5);
  }
  {  // Averaging per-micro-batch means: each sequence weighted 1/2 whatever its token count.
    train::Runtime rt(config);
    rt.optimizer().zero_grad();
    for (const Batch& mb : micro) {
      Tensor loss = rt.model().loss_sum(mb.input_ids, mb.targets);
      float mean_of_means = 1.0f / static_cast<float>(mb.num_target_tokens * micro.size());
      autograd::backward(ops::scale(loss, mean_of_means));
    }
    EXPECT_GT(gradient_error(rt, expected), 1e-2);
  }
}
