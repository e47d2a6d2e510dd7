// Helpers shared by the CUDA tests: the skip check, random inputs and comparisons against the
// CPU backend.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "shardtrain/backend/backend.h"
#include "shardtrain/tensor/tensor.h"
#ifdef SHARDTRAIN_HAVE_CUDA
#include "shardtrain/backend/cuda.h"
#endif

namespace shardtrain::testing {

inline std::string no_cuda_reason() {
#ifdef SHARDTRAIN_HAVE_CUDA
  return "cuda::device_count() is " + std::to_string(cuda::device_count()) +
         " (no driver, no device, or none with compute capability 8.0+)";
#else
  return "this build has no CUDA backend (SHARDTRAIN_CUDA=OFF or no nvcc)";
#endif
}

// Skips the test on machines (or builds) without a usable GPU.
#define REQUIRE_CUDA()                                                            \
  do {                                                                            \
    if (!::shardtrain::cuda_backend_available())                                  \
      GTEST_SKIP() << "no CUDA GPU: " << ::shardtrain::testing::no_cuda_reason(); \
  } while (0)

inline Backend& cpu() {
  return backend_for(Device::cpu());
}
inline Backend& gpu() {
  return backend_for(Device::cuda(0));
}
inline Device cuda0() {
  return Device::cuda(0);
}

// Normal(0, stddev) values of `dtype` on the CPU (values already rounded to the dtype).
inline Tensor random_cpu(const Shape& shape, DType dtype, uint64_t seed, float stddev = 1.0f) {
  Generator gen(seed);
  return randn(shape, gen, stddev, dtype, Device::cpu());
}

// Attention keys [B, H, S, D] with key j scaled by 1 + j / 16, so that later keys give ever
// larger scores (about 85 in log2 units at S = 300 for N(0, 1) inputs): the fused forward must
// then raise its rows' running max well after the first key tile, which N(0, 1) inputs almost
// never make it do (it lets scores pass the max by up to 2^8 before rescaling).
inline Tensor growing_keys(const Tensor& k) {
  std::vector<float> x = k.to_float_vector();
  const int64_t S = k.shape()[2], D = k.shape()[3];
  for (size_t i = 0; i < x.size(); ++i)
    x[i] *= 1.0f + static_cast<float>((static_cast<int64_t>(i) / D) % S) / 16.0f;
  return from_floats(x, k.shape(), k.dtype());
}

inline std::vector<int64_t> random_ids(int64_t n, int64_t limit, uint64_t seed) {
  Generator gen(seed);
  std::vector<float> u(static_cast<size_t>(n));
  gen.uniform(u.data(), n);
  std::vector<int64_t> ids(u.size());
  for (size_t i = 0; i < u.size(); ++i)
    ids[i] = std::min<int64_t>(limit - 1, static_cast<int64_t>(u[i] * static_cast<float>(limit)));
  return ids;
}

inline const char* name(DType t) {
  return dtype_name(t).data();
}

// Per-element tolerance of values stored in `t` (its rounding, plus fp32 ordering effects).
inline float tolerance(DType t) {
  switch (t) {
    case DType::BF16:
      return 1.6e-2f;
    case DType::F16:
      return 2e-3f;
    default:
      return 2e-5f;
  }
}

// |got - want| <= atol + rtol * |want| for every element; reports the worst element.
inline void expect_close(const Tensor& got, const Tensor& want, float atol, float rtol,
                         const std::string& what) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  const std::vector<float> g = got.to_float_vector(), w = want.to_float_vector();
  int64_t worst = -1;
  double worst_excess = 0.0;
  int64_t bad = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const double err = std::fabs(static_cast<double>(g[i]) - w[i]);
    const double bound = atol + rtol * std::fabs(static_cast<double>(w[i]));
    const bool ok = err <= bound || (std::isnan(g[i]) && std::isnan(w[i])) ||
                    (std::isinf(g[i]) && g[i] == w[i]);
    if (!ok) {
      ++bad;
      if (err - bound > worst_excess || worst < 0) {
        worst_excess = err - bound;
        worst = static_cast<int64_t>(i);
      }
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << g.size() << " elements differ; worst at "
                    << worst << ": got " << (worst >= 0 ? g[worst] : 0.0f) << ", want "
                    << (worst >= 0 ? w[worst] : 0.0f) << " (atol " << atol << ", rtol " << rtol
                    << ")";
}

// Tolerance relative to the largest magnitude of `want` (for results of long sums), judged
// against at least `floor`: a result that cancels to almost nothing (a gradient that is zero in
// exact arithmetic) carries the rounding noise of the terms that cancelled, so its floor is their
// scale.
inline void expect_close_scaled(const Tensor& got, const Tensor& want, float rel,
                                const std::string& what, float floor = 1e-3f) {
  const std::vector<float> w = want.to_float_vector();
  float peak = 0.0f;
  for (float x : w) peak = std::max(peak, std::fabs(x));
  expect_close(got, want, rel * std::max(peak, floor), 0.0f, what);
}

inline void expect_bitwise_equal(const Tensor& a, const Tensor& b, const std::string& what) {
  ASSERT_EQ(a.nbytes(), b.nbytes()) << what;
  const Tensor ha = a.to(Device::cpu()), hb = b.to(Device::cpu());
  EXPECT_EQ(0, std::memcmp(ha.data_ptr(), hb.data_ptr(), ha.nbytes())) << what;
}

}  // namespace shardtrain::testing
