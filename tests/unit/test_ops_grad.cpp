// Every differentiable op against central finite differences, on several shapes including
// non-power-of-two ones.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

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
  gradcheck([](const std::vector<Tensor>& t) { return ops::rope(t[0], RopeParams(10000.0f)); },
            {param({2, 5, 3, 8}, gen)});
  gradcheck([](const std::vector<Tensor>& t) { return ops::rope(t[0], RopeParams(500.0f), 3); },
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

// fp16 scores whose raw dot product passes fp16's largest value (65504) but whose scaled value
// does not: the scale is applied before the scores are stored, so the row is not NaN, and the
// result is the fused attention's.
TEST(OpsGrad, Fp16PlainAttentionScalesTheScoresBeforeStoringThem) {
  const int64_t d = 128;
  Generator gen(12);
  std::vector<float> ones_q(static_cast<size_t>(3 * d), 23.0f);  // q.k = 128 * 529 = 67712
  Tensor q = from_floats(ones_q, {1, 1, 3, d}, DType::F16);
  Tensor k = from_floats(ones_q, {1, 1, 3, d}, DType::F16);
  Tensor v = randn({1, 1, 3, d}, gen).to(DType::F16);
  std::vector<float> plain = ops::attention(q, k, v, ops::AttentionImpl::Plain).to_float_vector();
  std::vector<float> fused = ops::attention(q, k, v, ops::AttentionImpl::Fused).to_float_vector();
  for (size_t i = 0; i < plain.size(); ++i) {
    ASSERT_TRUE(std::isfinite(plain[i])) << i;
    ASSERT_NEAR(plain[i], fused[i], 1e-2f) << i;
  }
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

TEST(OpsGrad, LinearCrossEntropy) {
  Generator gen(14);
  Tensor targets = from_ints({2, -100, 0, 4, -100, 1, 3}, {7});
  for (int64_t chunk : {1, 3, 7, 100}) {  // one row, ragged chunks, exactly all, more than all
    int64_t counted = 0;
    gradcheck(
        [&](const std::vector<Tensor>& t) {
          return ops::linear_cross_entropy_sum(t[0], t[1], targets, chunk, &counted);
        },
        {param({7, 6}, gen), param({5, 6}, gen)});
    EXPECT_EQ(counted, 5) << "chunk " << chunk;
  }
}

// The fused head + loss against linear then cross_entropy_sum: the loss and both gradients.
void expect_fused_loss_matches(DType dtype, int64_t chunk, double rtol, bool bitwise) {
  SCOPED_TRACE(std::string(dtype_name(dtype)) + " chunk " + std::to_string(chunk));
  Generator gen(15);
  const int64_t rows = 37, hidden = 24, vocab = 50;
  Tensor x0 = randn({rows, hidden}, gen).to(dtype), w0 = randn({vocab, hidden}, gen).to(dtype);
  std::vector<int64_t> ids(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i)
    ids[static_cast<size_t>(i)] = i % 5 == 3 ? -100 : (i * 7) % vocab;
  Tensor targets = from_ints(ids, {rows});
  auto run = [&](bool fused) {
    Tensor x = x0.clone(), w = w0.clone();
    autograd::set_requires_grad(x);
    autograd::set_requires_grad(w);
    Tensor loss = fused ? ops::linear_cross_entropy_sum(x, w, targets, chunk)
                        : ops::cross_entropy_sum(ops::linear(x, w), targets);
    // A loss-scale-like upstream gradient, so a backward that dropped it would show.
    autograd::backward(ops::scale(loss, 0.37f));
    return std::vector<std::vector<float>>{loss.to_float_vector(),
                                           autograd::grad(x).to_float_vector(),
                                           autograd::grad(w).to_float_vector()};
  };
  std::vector<std::vector<float>> a = run(false), b = run(true);
  const char* what[] = {"loss", "d(x)", "d(w)"};
  for (size_t k = 0; k < a.size(); ++k) {
    ASSERT_EQ(a[k].size(), b[k].size());
    double scale = 0;
    for (float v : a[k]) scale = std::max(scale, std::fabs(static_cast<double>(v)));
    for (size_t i = 0; i < a[k].size(); ++i) {
      if (bitwise)
        ASSERT_EQ(a[k][i], b[k][i]) << what[k] << " element " << i;
      else
        ASSERT_NEAR(a[k][i], b[k][i], rtol * scale) << what[k] << " element " << i;
    }
  }
}

TEST(OpsGrad, LinearCrossEntropyMatchesUnfused) {
  // One chunk over all rows runs the unfused ops' arithmetic exactly.
  expect_fused_loss_matches(DType::F32, 37, 0, true);
  expect_fused_loss_matches(DType::BF16, 64, 0, true);
  // Chunks regroup the sums over rows (the loss, d(w)): rounding-level differences only.
  expect_fused_loss_matches(DType::F32, 8, 1e-5, false);
  expect_fused_loss_matches(DType::F32, 5, 1e-5, false);
  // d(w) sums its chunks in fp32 and rounds once, so bf16 stays within one rounding.
  expect_fused_loss_matches(DType::BF16, 8, 1e-2, false);
}

TEST(OpsGrad, LinearCrossEntropyFrozenWeight) {
  // A frozen head (QLoRA): only the input gets a gradient, the same one as unfused.
  Generator gen(16);
  Tensor x = param({9, 4}, gen), w = randn({6, 4}, gen);
  Tensor targets = from_ints({0, 1, 2, 3, 4, 5, 0, -100, 2}, {9});
  autograd::backward(ops::linear_cross_entropy_sum(x, w, targets, 4));
  std::vector<float> fused = autograd::grad(x).to_float_vector();
  Tensor x2 = x.detach();
  autograd::set_requires_grad(x2);
  autograd::backward(ops::cross_entropy_sum(ops::linear(x2, w), targets));
  std::vector<float> plain = autograd::grad(x2).to_float_vector();
  ASSERT_EQ(fused.size(), plain.size());
  for (size_t i = 0; i < fused.size(); ++i) EXPECT_NEAR(fused[i], plain[i], 1e-6f) << i;
  EXPECT_FALSE(autograd::grad(w).defined());
}

TEST(OpsGrad, LinearCrossEntropyNoRows) {
  // An empty batch: a zero loss and zero gradients, not whatever memory held.
  Generator gen(18);
  Tensor x = param({0, 4}, gen), w = param({6, 4}, gen);
  Tensor loss = ops::linear_cross_entropy_sum(x, w, from_ints({}, {0}), 3);
  EXPECT_EQ(loss.item(), 0.0f);
  autograd::backward(loss);
  for (float v : autograd::grad(w).to_float_vector()) ASSERT_EQ(v, 0.0f);
}

TEST(OpsGrad, LinearCrossEntropyErrors) {
  Generator gen(17);
  Tensor x = randn({3, 4}, gen), w = randn({5, 4}, gen);
  EXPECT_THROW(ops::linear_cross_entropy_sum(x, randn({5, 3}, gen), from_ints({0, 1, 2}, {3}), 2),
               ShapeError);
  EXPECT_THROW(ops::linear_cross_entropy_sum(x, w, from_ints({0, 1}, {2}), 2), ShapeError);
  EXPECT_THROW(ops::linear_cross_entropy_sum(x, w, from_ints({0, 1, 2}, {3}), 0), ShapeError);
  try {
    ops::linear_cross_entropy_sum(x, w, from_ints({0, 9, 2}, {3}), 2);
    FAIL() << "expected an error";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("target 9 at row 1"), std::string::npos) << e.what();
  }
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

// Inputs an op cannot take are ShapeErrors, not a flat-order pairing, a division by zero or a
// wrapped-around row address.
TEST(OpsShapes, MismatchedAndEmptyInputsAreRefused) {
  Generator gen(7);
  Tensor a = param({2, 3}, gen), b = param({3, 2}, gen);
  EXPECT_THROW(ops::add(a, b), ShapeError);
  EXPECT_THROW(ops::mul(a, b), ShapeError);
  EXPECT_THROW(ops::rms_norm(param({3, 0}, gen), param({0}, gen), 1e-5f), ShapeError);
  EXPECT_THROW(ops::linear(param({3, 0}, gen), param({4, 0}, gen)), ShapeError);
  // INT64_MIN once passed as "no id is ignored", and its row address wrapped around to row 0.
  Tensor ids = from_ints({std::numeric_limits<int64_t>::min(), 0}, {2});
  EXPECT_THROW(ops::embedding(param({5, 4}, gen), ids), ShapeError);
  EXPECT_NO_THROW(ops::embedding(param({5, 4}, gen), from_ints({4, 0}, {2})));
}
