// One forward and backward of a model in tests: its loss and every parameter's gradient, and two
// such steps compared bit for bit.
#pragma once
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "shardtrain/autograd/node.h"
#include "shardtrain/nn/module.h"

namespace shardtrain::testing {

// What a step yields for comparison: the loss and each parameter's gradient (as fp32), by name.
struct LossAndGradients {
  std::map<std::string, std::vector<float>> grads;
  float loss = 0;
};

// Drops every parameter's gradient, so that the next backward starts from none.
inline void clear_gradients(nn::Module& model) {
  for (auto& [name, p] : model.named_parameters()) autograd::set_grad(*p, Tensor());
}

// Every parameter's gradient after a backward; a parameter without one fails the test.
inline std::map<std::string, std::vector<float>> gradients_of(nn::Module& model) {
  std::map<std::string, std::vector<float>> grads;
  for (auto& [name, p] : model.named_parameters()) {
    const Tensor g = autograd::grad(*p);
    EXPECT_TRUE(g.defined()) << name << " got no gradient";
    if (g.defined()) grads[name] = g.to_float_vector();
  }
  return grads;
}

// `got` has `want`'s gradients and loss to the bit; `reference` says what `want` was run with.
inline void expect_bitwise_equal_step(const LossAndGradients& got, const LossAndGradients& want,
                                      const std::string& what, const std::string& reference) {
  ASSERT_EQ(got.grads.size(), want.grads.size()) << what;
  for (const auto& [name, g] : got.grads) {
    const std::vector<float>& w = want.grads.at(name);
    ASSERT_EQ(g.size(), w.size()) << what << " " << name;
    EXPECT_EQ(std::memcmp(g.data(), w.data(), g.size() * sizeof(float)), 0)
        << what << ": the gradient of " << name << " differs from " << reference;
  }
  EXPECT_EQ(std::memcmp(&got.loss, &want.loss, sizeof(float)), 0)
      << what << ": loss differs: " << got.loss << " vs " << want.loss;
}

}  // namespace shardtrain::testing
