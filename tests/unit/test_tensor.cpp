// Tensors: views and row slices sharing storage, dtype round trips, counter-based random numbers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "shardtrain/tensor/tensor.h"

namespace shardtrain {
namespace {

std::vector<float> iota_floats(int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), 0.0f);
  return v;
}

TEST(Tensor, FactoriesAndDescribe) {
  Tensor z = zeros({2, 3});
  EXPECT_EQ(z.numel(), 6);
  EXPECT_EQ(z.dim(), 2);
  EXPECT_EQ(z.size(-1), 3);
  EXPECT_EQ(z.describe(), "f32[2, 3] on cpu");
  for (float x : z.to_float_vector()) EXPECT_EQ(x, 0.0f);
  Tensor f = full({4}, 2.5f, DType::BF16);
  EXPECT_EQ(f.nbytes(), 8u);
  for (float x : f.to_float_vector()) EXPECT_EQ(x, 2.5f);
  EXPECT_EQ(ones({1}).item(), 1.0f);
  EXPECT_THROW(z.size(2), ShapeError);
  EXPECT_THROW(z.item(), ShapeError);
  EXPECT_THROW(z.data<uint16_t>(), Error);  // wrong element size for f32
}

TEST(Tensor, ViewInfersOneExtentAndSharesStorage) {
  Tensor t = from_floats(iota_floats(24), {2, 3, 4});
  Tensor v = t.view({-1, 4});
  EXPECT_EQ(v.shape(), (Shape{6, 4}));
  Tensor w = t.view({4, -1});
  EXPECT_EQ(w.shape(), (Shape{4, 6}));
  EXPECT_EQ(v.data_ptr(), t.data_ptr());
  v.data<float>()[5] = -1.0f;  // element [1, 1] of the view is element [0, 1, 1] of t
  EXPECT_EQ(t.to_float_vector()[5], -1.0f);
  EXPECT_THROW(t.view({5, -1}), ShapeError);
  EXPECT_THROW(t.view({-1, -1}), ShapeError);
  EXPECT_THROW(t.view({5, 5}), ShapeError);
}

TEST(Tensor, SliceRowsSharesStorage) {
  Tensor t = from_floats(iota_floats(12), {4, 3});
  Tensor s = t.slice_rows(1, 2);
  EXPECT_EQ(s.shape(), (Shape{2, 3}));
  EXPECT_EQ(s.to_float_vector(), (std::vector<float>{3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(s.data<float>(), t.data<float>() + 3);
  s.data<float>()[0] = 100.0f;
  EXPECT_EQ(t.to_float_vector()[3], 100.0f);
  // Slices of views and views of slices compose.
  Tensor s2 = s.view({-1}).slice_rows(4, 2);
  EXPECT_EQ(s2.to_float_vector(), (std::vector<float>{7, 8}));
  EXPECT_THROW(t.slice_rows(3, 2), ShapeError);
  EXPECT_THROW(t.slice_rows(-1, 1), ShapeError);
  // A clone does not share storage.
  Tensor c = s.clone();
  c.data<float>()[1] = -5.0f;
  EXPECT_EQ(t.to_float_vector()[4], 4.0f);
}

TEST(Tensor, DtypeRoundTrips) {
  std::vector<float> values = {0.1f, -3.14159f, 65504.0f, 1e-6f, -0.0f, 1e5f, 0.33333334f};
  Tensor f32 = from_floats(values, {static_cast<int64_t>(values.size())});
  for (DType t : {DType::BF16, DType::F16}) {
    Tensor low = f32.to(t);
    EXPECT_EQ(low.dtype(), t);
    std::vector<float> back = low.to(DType::F32).to_float_vector();
    for (size_t i = 0; i < values.size(); ++i) {
      const float expected = round_to(t, values[i]);
      EXPECT_EQ(float_bits(back[i]), float_bits(expected)) << dtype_name(t) << " " << values[i];
    }
    // Rounded values survive the trip exactly: low -> f32 -> low is the identity on bits.
    Tensor again = low.to(DType::F32).to(t);
    EXPECT_EQ(std::memcmp(again.data_ptr(), low.data_ptr(), low.nbytes()), 0);
  }
  // f16 overflow goes to infinity; bf16 keeps the range of f32.
  EXPECT_TRUE(std::isinf(f32.to(DType::F16).to_float_vector()[5]));
  EXPECT_FALSE(std::isinf(f32.to(DType::BF16).to_float_vector()[5]));
  // Integers convert by value.
  Tensor ids = from_ints({3, -2, 7}, {3});
  EXPECT_EQ(ids.to(DType::F32).to_float_vector(), (std::vector<float>{3, -2, 7}));
  EXPECT_EQ(ids.to(DType::I32).to_int_vector(), (std::vector<int64_t>{3, -2, 7}));
  // copy_from converts too.
  Tensor dst = empty({3}, DType::BF16);
  dst.copy_from(ids);
  EXPECT_EQ(dst.to_float_vector(), (std::vector<float>{3, -2, 7}));
  EXPECT_THROW(dst.copy_from(zeros({4})), ShapeError);
}

TEST(Generator, SameSeedAndOffsetGiveTheSameNumbers) {
  Generator a(42), b(42), c(43);
  std::vector<float> x(1000), y(1000), z(1000);
  a.normal(x.data(), 1000);
  b.normal(y.data(), 1000);
  c.normal(z.data(), 1000);
  EXPECT_EQ(x, y);
  EXPECT_NE(x, z);
  EXPECT_EQ(a.offset(), 1000u);

  // Counter-based: two draws of 500 equal one draw of 1000, and a saved state replays.
  Generator d(42);
  std::vector<float> first(500), second(500);
  d.normal(first.data(), 500);
  const uint64_t seed = d.seed(), offset = d.offset();
  d.normal(second.data(), 500);
  EXPECT_TRUE(std::equal(first.begin(), first.end(), x.begin()));
  EXPECT_TRUE(std::equal(second.begin(), second.end(), x.begin() + 500));
  Generator e;
  e.set_state(seed, offset);
  std::vector<float> replay(500);
  e.normal(replay.data(), 500);
  EXPECT_EQ(replay, second);

  // Tensor factories draw from the same stream.
  Generator f(42);
  EXPECT_EQ(randn({10, 100}, f).to_float_vector(), x);
}

TEST(Generator, NormalAndUniformHaveTheRightMoments) {
  constexpr int64_t n = 100000;
  Generator g(7);
  std::vector<float> v(n);
  g.normal(v.data(), n);
  double mean = 0, sq = 0;
  for (float x : v) {
    ASSERT_TRUE(std::isfinite(x));
    mean += x;
  }
  mean /= n;
  for (float x : v) sq += (x - mean) * (x - mean);
  const double stddev = std::sqrt(sq / (n - 1));
  // Standard errors: 1/sqrt(n) = 0.0032 for the mean, ~0.0022 for the standard deviation.
  EXPECT_NEAR(mean, 0.0, 0.015);
  EXPECT_NEAR(stddev, 1.0, 0.012);

  std::vector<float> u(n);
  g.uniform(u.data(), n);
  double umean = 0;
  for (float x : u) {
    ASSERT_GE(x, 0.0f);
    ASSERT_LT(x, 1.0f);
    umean += x;
  }
  EXPECT_NEAR(umean / n, 0.5, 0.005);

  Generator h(1);
  Tensor r = randn({n}, h, 0.02f);
  double rs = 0;
  for (float x : r.to_float_vector()) rs += static_cast<double>(x) * x;
  EXPECT_NEAR(std::sqrt(rs / n), 0.02, 0.0005);
  Tensor ur = rand_uniform({1000}, h, -2.0f, 3.0f);
  for (float x : ur.to_float_vector()) {
    EXPECT_GE(x, -2.0f);
    EXPECT_LT(x, 3.0f);
  }
}

}  // namespace
}  // namespace shardtrain
