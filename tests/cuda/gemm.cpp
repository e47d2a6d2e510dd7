// cuBLASLt matrix products against the CPU backend: every transpose combination, batches with
// strides (including a broadcast operand) and offsets, beta != 0, and mixed dtypes.
#include <gtest/gtest.h>

#include "cuda_test_util.h"

namespace shardtrain {
namespace {

using testing::cpu;
using testing::cuda0;
using testing::gpu;
using testing::random_cpu;

struct Case {
  int64_t m, n, k, batch;
  bool broadcast_b;  // stride_b = 0
  int64_t offset;    // elements before the first matrix of every operand
};

float gemm_tolerance(DType in, DType out) {
  if (out == DType::BF16) return 1e-2f;
  if (out == DType::F16) return 2e-3f;
  if (in == DType::F32) return 2e-5f;
  return 1e-4f;  // 16-bit inputs, fp32 output: only summation order differs
}

void check_gemm(const Case& c, bool ta, bool tb, DType da, DType db, DType dc, float beta) {
  GemmArgs g;
  g.trans_a = ta;
  g.trans_b = tb;
  g.m = c.m;
  g.n = c.n;
  g.k = c.k;
  g.alpha = 0.75f;
  g.beta = beta;
  g.batch = c.batch;
  g.stride_a = c.m * c.k + 3;  // gaps between matrices
  g.stride_b = c.broadcast_b ? 0 : c.k * c.n;
  g.stride_c = c.m * c.n;
  g.offset_a = g.offset_b = g.offset_c = c.offset;
  const int64_t a_len = c.offset + (c.batch - 1) * g.stride_a + c.m * c.k;
  const int64_t b_len = c.offset + (c.batch - 1) * g.stride_b + c.k * c.n;
  const int64_t c_len = c.offset + (c.batch - 1) * g.stride_c + c.m * c.n + 5;  // tail untouched
  Tensor a = random_cpu({a_len}, da, 100), b = random_cpu({b_len}, db, 101);
  Tensor want = random_cpu({c_len}, dc, 102);
  Tensor got = want.to(cuda0());
  cpu().gemm(g, a, b, want);
  gpu().gemm(g, a.to(cuda0()), b.to(cuda0()), got);
  std::ostringstream what;
  what << "gemm m=" << c.m << " n=" << c.n << " k=" << c.k << " batch=" << c.batch
       << (c.broadcast_b ? " (B broadcast)" : "") << " offset=" << c.offset << " ta=" << ta
       << " tb=" << tb << " " << testing::name(da) << "x" << testing::name(db) << "->"
       << testing::name(dc) << " beta=" << beta;
  testing::expect_close_scaled(got, want, gemm_tolerance(da == db ? da : DType::F32, dc),
                               what.str());
}

TEST(CudaGemm, TransposesBatchesAndStrides) {
  REQUIRE_CUDA();
  const Case cases[] = {{1, 1, 1, 1, false, 0},     {17, 33, 65, 1, false, 0},
                        {64, 128, 96, 1, false, 8}, {130, 70, 257, 3, false, 0},
                        {31, 9, 16, 4, true, 16},   {256, 256, 256, 2, false, 0}};
  for (const Case& c : cases)
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (DType t : {DType::F32, DType::BF16, DType::F16})
          check_gemm(c, ta, tb, t, t, t, c.batch > 1 ? 0.5f : 0.0f);
}

TEST(CudaGemm, MixedDtypes) {
  REQUIRE_CUDA();
  const Case c{48, 40, 72, 2, false, 0};
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      check_gemm(c, ta, tb, DType::BF16, DType::BF16, DType::F32, 1.0f);  // direct on cuBLASLt
      check_gemm(c, ta, tb, DType::F16, DType::F16, DType::F32, 0.0f);
      check_gemm(c, ta, tb, DType::F32, DType::BF16, DType::F32, 0.5f);  // A and B differ
      check_gemm(c, ta, tb, DType::F32, DType::F32, DType::BF16, 0.5f);  // C staged in f32
      check_gemm(c, ta, tb, DType::BF16, DType::BF16, DType::F16, 0.0f);
    }
}

TEST(CudaGemm, OddOffsetsAndDegenerateShapes) {
  REQUIRE_CUDA();
  // Offsets that leave pointers only 4-byte aligned.
  check_gemm({19, 23, 29, 2, false, 1}, false, true, DType::F32, DType::F32, DType::F32, 0.25f);
  // k = 0: C = beta * C.
  GemmArgs g;
  g.m = 3;
  g.n = 4;
  g.k = 0;
  g.beta = 0.5f;
  Tensor c = random_cpu({12}, DType::F32, 103);
  Tensor got = c.to(cuda0());
  Tensor a = empty({0}, DType::F32, cuda0()), b = empty({0}, DType::F32, cuda0());
  gpu().gemm(g, a, b, got);
  cpu().gemm(g, empty({0}), empty({0}), c);
  testing::expect_close(got, c, 0.0f, 0.0f, "gemm with k = 0");
}

TEST(CudaGemm, LargeSquareBf16MatchesCpu) {
  REQUIRE_CUDA();
  check_gemm({512, 384, 1024, 1, false, 0}, false, true, DType::BF16, DType::BF16, DType::BF16,
             0.0f);
}

}  // namespace
}  // namespace shardtrain
