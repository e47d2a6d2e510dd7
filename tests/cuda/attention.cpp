// Fused causal attention against the CPU backend: sequence lengths that are and are not
// multiples of the tiles, head dims 64 and 128 (tensor-core kernels) and others (CUDA-core
// kernels), grouped-query heads, every float dtype, and bit-reproducible backward passes.
#include <gtest/gtest.h>

#include <cmath>

#include "cuda_test_util.h"

namespace shardtrain {
namespace {

using testing::cpu;
using testing::cuda0;
using testing::gpu;
using testing::random_cpu;

struct Dims {
  int64_t B, Hq, Hkv, S, D;
};

std::string describe(const Dims& d, DType t) {
  std::ostringstream s;
  s << dtype_name(t) << " B=" << d.B << " Hq=" << d.Hq << " Hkv=" << d.Hkv << " S=" << d.S
    << " D=" << d.D;
  return s.str();
}

// Errors relative to the largest magnitude: 16-bit runs round P and dS to 16 bits before the
// second matrix product, as flash attention does.
float out_tolerance(DType t) {
  return t == DType::F32 ? 1e-5f : t == DType::F16 ? 4e-3f : 2e-2f;
}
float grad_tolerance(DType t) {
  return t == DType::F32 ? 1e-4f : t == DType::F16 ? 1e-2f : 4e-2f;
}

void check_attention(const Dims& d, DType t,
                     AttentionBackwardAlgo algo = AttentionBackwardAlgo::Deterministic,
                     bool growing = false) {
  const std::string what = describe(d, t) + (growing ? ", growing keys" : "");
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.D));
  Tensor q = random_cpu({d.B, d.Hq, d.S, d.D}, t, 200);
  Tensor k = random_cpu({d.B, d.Hkv, d.S, d.D}, t, 201);
  if (growing) k = testing::growing_keys(k);
  Tensor v = random_cpu({d.B, d.Hkv, d.S, d.D}, t, 202);
  Tensor gq = q.to(cuda0()), gk = k.to(cuda0()), gv = v.to(cuda0());

  Tensor out_want = empty(q.shape(), t), lse_want = empty({d.B, d.Hq, d.S});
  Tensor out_got = empty(q.shape(), t, cuda0()),
         lse_got = empty({d.B, d.Hq, d.S}, DType::F32, cuda0());
  cpu().attention_forward(q, k, v, scale, out_want, lse_want);
  gpu().attention_forward(gq, gk, gv, scale, out_got, lse_got);
  testing::expect_close(lse_got, lse_want, 2e-4f, 1e-5f, what + " lse");
  testing::expect_close_scaled(out_got, out_want, out_tolerance(t), what + " out");

  // Backward from the CPU forward's outputs so both sides see identical inputs.
  Tensor dout = random_cpu(q.shape(), t, 203);
  Tensor dq_want = empty(q.shape(), t), dk_want = empty(k.shape(), t),
         dv_want = empty(v.shape(), t);
  cpu().attention_backward(q, k, v, out_want, lse_want, dout, scale, dq_want, dk_want, dv_want,
                           AttentionBackwardAlgo::Deterministic);
  Tensor g_out = out_want.to(cuda0()), g_lse = lse_want.to(cuda0()), g_dout = dout.to(cuda0());
  Tensor dq = empty(q.shape(), t, cuda0()), dk = empty(k.shape(), t, cuda0()),
         dv = empty(v.shape(), t, cuda0());
  gpu().attention_backward(gq, gk, gv, g_out, g_lse, g_dout, scale, dq, dk, dv, algo);
  // Gradients are judged at unit scale at least (the inputs are N(0, 1)): with S = 1, dq and dk
  // are exactly zero in exact arithmetic and both backends return only rounding residues of
  // dP - delta, about 1e-6 each.
  testing::expect_close_scaled(dq, dq_want, grad_tolerance(t), what + " dq", 1.0f);
  testing::expect_close_scaled(dk, dk_want, grad_tolerance(t), what + " dk", 1.0f);
  testing::expect_close_scaled(dv, dv_want, grad_tolerance(t), what + " dv", 1.0f);

  // A second backward gives the same bits, except dQ of the one-pass backward on tensor cores,
  // whose atomic sums may come out in another order (still within the tolerance).
  Tensor dq2 = empty(q.shape(), t, cuda0()), dk2 = empty(k.shape(), t, cuda0()),
         dv2 = empty(v.shape(), t, cuda0());
  gpu().attention_backward(gq, gk, gv, g_out, g_lse, g_dout, scale, dq2, dk2, dv2, algo);
  if (algo == AttentionBackwardAlgo::AtomicDq && cuda_attention_uses_tensor_cores(t, d.D))
    testing::expect_close_scaled(dq2, dq_want, grad_tolerance(t), what + " second dq", 1.0f);
  else
    testing::expect_bitwise_equal(dq2, dq, what + " dq determinism");
  testing::expect_bitwise_equal(dk2, dk, what + " dk determinism");
  testing::expect_bitwise_equal(dv2, dv, what + " dv determinism");
}

TEST(CudaAttention, TensorCoreKernelsMatchCpu) {
  REQUIRE_CUDA();
  for (DType t : {DType::BF16, DType::F16})
    for (int64_t D : {64, 128})
      for (int64_t S : {1, 17, 128, 300}) check_attention({2, 4, 4, S, D}, t);
}

TEST(CudaAttention, ScoresThatGrowAlongTheKeysMatchCpu) {
  REQUIRE_CUDA();
  for (DType t : {DType::BF16, DType::F16})
    for (int64_t D : {64, 128}) check_attention({1, 2, 2, 300, D}, t, {}, true);
}

TEST(CudaAttention, OnePassBackwardWithAtomicDqMatchesCpu) {
  REQUIRE_CUDA();
  for (DType t : {DType::BF16, DType::F16})
    for (int64_t D : {64, 128})
      for (int64_t S : {1, 17, 128, 300})
        check_attention({2, 4, 4, S, D}, t, AttentionBackwardAlgo::AtomicDq);
  check_attention({1, 8, 2, 77, 64}, DType::BF16, AttentionBackwardAlgo::AtomicDq);
  check_attention({2, 4, 1, 130, 128}, DType::BF16, AttentionBackwardAlgo::AtomicDq);
  check_attention({1, 2, 2, 65, 64}, DType::F32, AttentionBackwardAlgo::AtomicDq);  // CUDA cores
}

TEST(CudaAttention, GroupedQueryHeads) {
  REQUIRE_CUDA();
  for (DType t : {DType::BF16, DType::F32}) {
    check_attention({1, 8, 2, 77, 64}, t);
    check_attention({2, 4, 1, 130, 128}, t);
  }
}

TEST(CudaAttention, MoreThan65535HeadsOrSequencesMatchCpu) {
  REQUIRE_CUDA();
  // Grids are one-dimensional: a batch or head count past the 65535 of a grid's y and z
  // dimensions is still one launch.
  check_attention({65537, 1, 1, 2, 64}, DType::BF16);
  check_attention({1, 65540, 16385, 3, 64}, DType::BF16, AttentionBackwardAlgo::AtomicDq);
}

TEST(CudaAttention, CudaCoreKernelsMatchCpu) {
  REQUIRE_CUDA();
  // f32 at the tensor-core head dims, and head dims the tensor-core kernels do not take.
  for (int64_t S : {1, 17, 128, 300}) check_attention({1, 2, 2, S, 64}, DType::F32);
  check_attention({1, 2, 2, 65, 128}, DType::F32);
  check_attention({2, 2, 1, 33, 32}, DType::BF16);
  check_attention({1, 3, 3, 20, 80}, DType::F16);
  check_attention({1, 1, 1, 9, 256}, DType::F32);
}

TEST(CudaAttention, MixedDtypesAreStaged) {
  REQUIRE_CUDA();
  // bf16 q with f32 k/v and an f32 output: computed in fp32 (q widened exactly, k and v read as
  // they are), as the CPU backend computes the same call. Rounding k and v to bf16 first would
  // move the lse by about 1e-3, ten times the bound below.
  const Dims d{1, 2, 2, 40, 64};
  Tensor q = random_cpu({1, 2, 40, 64}, DType::BF16, 210);
  Tensor k = random_cpu({1, 2, 40, 64}, DType::F32, 211);
  Tensor v = random_cpu({1, 2, 40, 64}, DType::F32, 212);
  Tensor out_want = empty({1, 2, 40, 64}), lse_want = empty({1, 2, 40});
  cpu().attention_forward(q, k, v, 0.125f, out_want, lse_want);
  Tensor out = empty({1, 2, 40, 64}, DType::F32, cuda0());
  Tensor lse = empty({1, 2, 40}, DType::F32, cuda0());
  gpu().attention_forward(q.to(cuda0()), k.to(cuda0()), v.to(cuda0()), 0.125f, out, lse);
  testing::expect_close_scaled(out, out_want, out_tolerance(DType::F32),
                               describe(d, DType::BF16) + " staged out");
  testing::expect_close(lse, lse_want, 2e-4f, 1e-5f, "staged lse");
}

}  // namespace
}  // namespace shardtrain
