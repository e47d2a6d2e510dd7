// Every differentiable op against central finite differences, on several shapes including
// non-power-of-two ones.
#include <gtest/gtest.h>

#include "gradcheck.h"
#include "shardtrain/ops/ops.h"

using namespace shardtrain;
using shardtrain::testing::gradcheck;
using shardtrain::testing::param;

class OpsGrad : public ::testing::TestWithParam<int> {};

TEST(OpsGrad, Linear) {
  Generator gen(1);
  for (auto [rows, in, out] : {std::tuple{3, 5, 7}, {4, 16, 8}, {1, 9, 2}}) {
    gradcheck([](const std::vector<Tensor>& t) { return ops::linear(t[0], t[1]); },
              {param({rows, in}, gen), param({out, in}, gen)});
  }
  gradcheck([](const std::vector<Tensor>& t) { return ops::linear(t[0], t[1]); },
            {param({2, 3, 5}, gen), param({6, 5}, gen)});
}

TEST(OpsGrad, Matmul) {
  Generator gen(2);
  gradcheck([](const std::vector<Tensor>& t) { return ops::matmul(t[0], t[1], false); },
            {param({2, 3, 5}, gen), param({2, 5, 4}, gen)});
  gradcheck([](const std::vector<Tensor>& t) { return ops::matmul(t[0], t[1], true); },
            {param({3, 7, 5}, gen), param({3, 6, 5}, gen)});
}

TEST(OpsGrad, Elementwise) {
  Generator gen(3);
  gradcheck([](const std::vector<Tensor>& t) { return ops::add(t[0], t[1]); },
            {param({3, 5}, gen), param({3, 5}, gen)});
  gradcheck([](const std::vector<Tensor>& t) { return ops::mul(t[0], t[1]); },
            {param({7, 3}, gen), param({7, 3}, gen)});
  gradcheck([](const std::vector<Tensor>& t) { return ops::scale(t[0], -1.5f); },
            {param({11}, gen)});
  gradcheck([](const std::vector<Tensor>& t) { return ops::mul_lastdim(t[0], t[1]); },
            {param({4, 3, 5}, gen), param({5}, gen)});
  gradcheck([](const std::vector<Tensor>& t) { return ops::swiglu(t[0], t[1]); },
            {param({5, 9}, gen), param({5, 9}, gen)});
}

TEST(OpsGrad, ShapeOps) {
  Generator gen(4);
  gradcheck([](const std::vector<Tensor>& t) { return ops::swap_dims_12(t[0]); },
            {param({2, 3, 5, 4}, gen)});
  gradcheck(
      [](const std::vector<Tensor>& t) {
        return ops::reshape(t[0], {5, -1});
      },
      {param({3, 5}, gen)});
  gradcheck([](const std::vector<Tensor>& t) { return ops::slice_rows(t[0], 1, 3); },
            {param({5, 3}, gen)});
}

TEST(OpsGrad, Embedding) {
  Generator gen(5);
  Tensor ids = from_ints({3, 0, 3, 7, 1, 3}, {2, 3});
  gradcheck([ids](const std::vector<Tensor>& t) { return ops::embedding(t[0], ids); },
            {param({9, 5}, gen)});
}

TEST(OpsGrad, RmsNorm) {
  Generator gen(6);
  for (auto [rows, h] : {std::pair{3, 8}, {5, 13}}) {
    gradcheck([](const std::vector<Tensor>& t) { return ops::rms_norm(t[0], t[1], 1e-5f); },
              {param({rows, h}, gen), param({h}, gen)});
  }
}

TEST(OpsGrad, Rope) {
  Generator gen(7);
  gradcheck([](const std::vector<Tensor>& t) { return ops::rope(t[0], 10000.0f); },
            {param({2, 5, 3, 8}, gen)});
  gradcheck([](const std::vector<Tensor>& t) { return ops::rope(t[0], 500.0f, 3); },
            {param({1, 7, 2, 6}, gen)});
}

TEST(OpsGrad, Attention) {
  Generator gen(8);
  for (auto impl : {ops::AttentionImpl::Plain, ops::AttentionImpl::Fused}) {
    for (auto [b, hq, hkv, s, d] : {std::tuple{1, 2, 2, 5, 4}, {2, 4, 2, 7, 6}, {1, 3, 1, 9, 8}}) {
      gradcheck(
          [impl](const std::vector<Tensor>& t) { return ops::attention(t[0], t[1], t[2], impl); },
          {param({b, hq, s, d}, gen), param({b, hkv, s, d}, gen), param({b, hkv, s, d}, gen)});
    }
  }
}

TEST(OpsGrad, AttentionPlainMatchesFused) {
  Generator gen(9);
  Tensor q = randn({2, 4, 11, 8}, gen), k = randn({2, 2, 11, 8}, gen),
         v = randn({2, 2, 11, 8}, gen);
  std::vector<float> a = ops::attention(q, k, v, ops::AttentionImpl::Plain).to_float_vector();
  std::vector<float> b = ops::attention(q, k, v, ops::AttentionImpl::Fused).to_float_vector();
  for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], 1e-5f);
}

TEST(OpsGrad, CrossEntropy) {
  Generator gen(10);
  Tensor targets = from_ints({2, -100, 0, 4, -100, 1, 3}, {7});
  int64_t counted = 0;
  gradcheck(
      [&](const std::vector<Tensor>& t) { return ops::cross_entropy_sum(t[0], targets, &counted); },
      {param({7, 5}, gen)});
  EXPECT_EQ(counted, 5);
}

TEST(OpsGrad, CrossEntropyRejectsBadTarget) {
  Generator gen(11);
  Tensor logits = randn({2, 5}, gen);
  try {
    ops::cross_entropy_sum(logits, from_ints({1, 5}, {2}));
    FAIL() << "expected an error";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("target 5 at row 1"), std::string::npos) << e.what();
  }
}

TEST(OpsGrad, ShapeMismatchIsAClearError) {
  Generator gen(12);
  Tensor x = randn({3, 5}, gen), w = randn({4, 6}, gen);
  try {
    ops::linear(x, w);
    FAIL() << "expected an error";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("f32[3, 5]"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("f32[4, 6]"), std::string::npos) << e.what();
  }
}

TEST(OpsGrad, ComposedGraphSharesInputs) {
  // x used by two branches: gradients from both must add up.
  Generator gen(13);
  gradcheck(
      [](const std::vector<Tensor>& t) {
        Tensor h = ops::linear(t[0], t[1]);
        return ops::add(ops::mul(h, h), ops::rms_norm(h, t[2], 1e-5f));
      },
      {param({4, 6}, gen), param({5, 6}, gen), param({5}, gen)});
}
