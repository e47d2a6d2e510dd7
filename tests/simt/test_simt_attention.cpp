// The fused attention kernels of kernels/flash_attention.cu, compiled for the CPU and run on the
// simt emulator, against the CPU backend: the tensor-core kernels (bf16/f16, head dims 64 and
// 128) and the CUDA-core ones (f32, other head dims), ragged sequence lengths, grouped-query
// heads (their group walked by one block, and split over several), both backward algorithms, one
// and two key m-tiles a warp in the dK/dV kernel, and every schedule giving bit-identical
// results.
#include <cmath>

#include "shardtrain/backend/cuda.h"
#include "simt_kernel_checks.h"

namespace shardtrain {
namespace {

using testing::cpu;
using testing::Operand;
using testing::random_cpu;

struct Case {
  int64_t B, Hq, Hkv, S, D;
  DType dtype;
  bool growing_keys = false;  // keys from testing::growing_keys()
};

std::string describe(const Case& c) {
  return std::string(dtype_name(c.dtype)) + " B=" + std::to_string(c.B) +
         " Hq=" + std::to_string(c.Hq) + " Hkv=" + std::to_string(c.Hkv) +
         " S=" + std::to_string(c.S) + " D=" + std::to_string(c.D) +
         (c.growing_keys ? ", growing keys" : "");
}

// The same bounds as tests/cuda/attention.cpp: 16-bit runs round P and dS to 16 bits before the
// second product, as flash attention does.
float out_tolerance(DType t) {
  return t == DType::F32 ? 1e-5f : t == DType::F16 ? 4e-3f : 2e-2f;
}
float grad_tolerance(DType t) {
  return t == DType::F32 ? 1e-4f : t == DType::F16 ? 1e-2f : 4e-2f;
}

// Forward, then backward from the CPU's forward outputs (so both sides see the same inputs):
// {out, lse, dq, dk, dv, number of mma instructions}. Checks on the way that the tensor cores were
// used exactly when the dtype and head dim call for them, and that no ldmatrix had a bank conflict
// (the tiles' rows are padded by 16 bytes so that every ldmatrix is one wavefront per matrix).
std::vector<Tensor> run_emulated(const Case& c, const Tensor& q, const Tensor& k, const Tensor& v,
                                 const Tensor& out_ref, const Tensor& lse_ref, const Tensor& dout,
                                 const kernels::AttentionBackwardOptions& options,
                                 const std::string& run) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.D));
  const kernels::AttentionDims dims{c.B, c.Hq, c.Hkv, c.S, c.D, scale};
  const Operand dq_(q), dk_(k), dv_(v), dout_(dout), out_in(out_ref), lse_in(lse_ref);
  const Operand out(q.shape(), c.dtype), lse(Shape{c.B, c.Hq, c.S}, DType::F32);
  const Operand dq(q.shape(), c.dtype), dk(k.shape(), c.dtype), dv(v.shape(), c.dtype);
  simt::reset_stats();
  kernels::attention_forward(dims, dq_.data(), dk_.data(), dv_.data(), c.dtype, out.data(),
                             lse.f32(), nullptr);
  testing::GuardedScratch scratch;
  kernels::attention_backward(dims, dq_.data(), dk_.data(), dv_.data(), out_in.data(), lse_in.f32(),
                              dout_.data(), c.dtype, dq.data(), dk.data(), dv.data(), options,
                              scratch, nullptr);
  const int64_t mma = simt::stats().mma;
  EXPECT_EQ(mma > 0, cuda::attention_uses_tensor_cores(-1, c.dtype, c.D))
      << run << ": tensor-core path taken " << mma;
  EXPECT_EQ(simt::stats().ldmatrix_bank_conflicts, 0) << run << ": ldmatrix bank conflicts";
  // The tensor-core products of the whole run, so that the caller can tell the backward
  // algorithms apart by the work they did.
  const Tensor products = from_floats({static_cast<float>(mma)}, Shape{1}, DType::F32);
  return {out.to_tensor(), lse.to_tensor(), dq.to_tensor(),
          dk.to_tensor(),  dv.to_tensor(),  products};
}

void check_case(const Case& c) {
  const std::string what = describe(c);
  SCOPED_TRACE(what);
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.D));
  const Tensor q = random_cpu({c.B, c.Hq, c.S, c.D}, c.dtype, 300);
  Tensor k = random_cpu({c.B, c.Hkv, c.S, c.D}, c.dtype, 301);
  if (c.growing_keys) k = testing::growing_keys(k);
  const Tensor v = random_cpu({c.B, c.Hkv, c.S, c.D}, c.dtype, 302);
  const Tensor dout = random_cpu(q.shape(), c.dtype, 303);
  Tensor out = empty(q.shape(), c.dtype), lse = empty({c.B, c.Hq, c.S});
  cpu().attention_forward(q, k, v, scale, out, lse);
  Tensor dq = empty(q.shape(), c.dtype), dk = empty(k.shape(), c.dtype),
         dv = empty(v.shape(), c.dtype);
  cpu().attention_backward(q, k, v, out, lse, dout, scale, dq, dk, dv,
                           AttentionBackwardAlgo::Deterministic);

  // Both algorithms, each with the group of query heads walked by one block and split over one
  // block per query head (their dK/dV partials added by a last pass).
  const int group = static_cast<int>(c.Hq / c.Hkv);
  std::vector<int> splits = {1};
  if (group > 1) splits.push_back(group);
  std::vector<Tensor> deterministic_whole_group;  // split 1, default key m-tiles
  for (int split : splits) {
    std::vector<Tensor> results[2];
    const AttentionBackwardAlgo algos[2] = {AttentionBackwardAlgo::Deterministic,
                                            AttentionBackwardAlgo::AtomicDq};
    for (int a = 0; a < 2; ++a) {
      const std::string label =
          what + (algos[a] == AttentionBackwardAlgo::AtomicDq ? ", atomic_dq" : ", deterministic") +
          ", group split " + std::to_string(split);
      testing::under_every_schedule(
          label,
          [&](const std::string& run) {
            return run_emulated(c, q, k, v, out, lse, dout, {algos[a], split}, run);
          },
          [&](const std::vector<Tensor>& got, const std::string& run) {
            testing::expect_close(got[1], lse, 2e-4f, 1e-5f, run + " lse");
            testing::expect_close_scaled(got[0], out, out_tolerance(c.dtype), run + " out");
            testing::expect_close_scaled(got[2], dq, grad_tolerance(c.dtype), run + " dq");
            testing::expect_close_scaled(got[3], dk, grad_tolerance(c.dtype), run + " dk");
            testing::expect_close_scaled(got[4], dv, grad_tolerance(c.dtype), run + " dv");
            results[a] = got;
          });
    }
    // The one-pass backward computes dK and dV exactly as the two-pass one does; only dQ's
    // sums are taken in another order.
    const std::string both = what + ", group split " + std::to_string(split);
    testing::expect_bitwise_equal(results[1][3], results[0][3], both + " dk of both algorithms");
    testing::expect_bitwise_equal(results[1][4], results[0][4], both + " dv of both algorithms");
    if (split == 1) deterministic_whole_group = results[0];
    const float products[2] = {results[0][5].to_float_vector()[0],
                               results[1][5].to_float_vector()[0]};
    if (cuda::attention_uses_tensor_cores(-1, c.dtype, c.D)) {
      // One pass does not recompute S and dP for dQ: fewer products than the two passes.
      EXPECT_LT(products[1], products[0]) << both << ": the one-pass backward did not run";
    } else {  // one backward: the same work and the same bits
      EXPECT_EQ(products[1], products[0]) << both;
      testing::expect_bitwise_equal(results[1][2], results[0][2], both + " dq of both algorithms");
    }
  }
  // At head dim 64 the dK/dV kernel's warps take two 16-key m-tiles by default. With one (the
  // form kept for head dim 128) each key still sums the same products over the same 16-query
  // chunks in the same order, so every result is the same to the bit.
  if (cuda_attention_uses_tensor_cores(c.dtype, c.D) && c.D == 64) {
    const std::string label = what + ", deterministic, one key m-tile a warp";
    testing::under_every_schedule(
        label,
        [&](const std::string& run) {
          kernels::AttentionBackwardOptions options{AttentionBackwardAlgo::Deterministic, 1};
          options.dkdv_m_tiles = 1;
          return run_emulated(c, q, k, v, out, lse, dout, options, run);
        },
        [&](const std::vector<Tensor>& got, const std::string& run) {
          for (int i : {2, 3, 4})
            testing::expect_bitwise_equal(
                got[i], deterministic_whole_group[i],
                run + " against two key m-tiles, result " + std::to_string(i));
        });
  }
}

// Sequence lengths below, at and past the tiles (64 keys, 128/64 query rows), grouped-query
// ratios 1, 2 and 4, both tensor-core head dims.
TEST(SimtAttention, TensorCoreKernelsMatchTheCpuBackendUnderEverySchedule) {
  for (DType t : {DType::BF16, DType::F16}) {
    check_case({1, 2, 1, 1, 64, t});
    check_case({1, 4, 2, 77, 64, t});
    check_case({1, 2, 1, 130, 128, t});
    check_case({2, 4, 1, 65, 64, t});
    check_case({1, 4, 1, 300, 64, t});
    check_case({1, 2, 1, 257, 128, t});
    check_case({1, 1, 1, 256, 64, t});
    check_case({1, 2, 1, 300, 64, t, true});
    check_case({1, 1, 1, 257, 128, t, true});
  }
}

// A GPU whose blocks may take 99 KiB of shared memory (compute capability 8.6 and 8.9) cannot
// launch the head-dim-128 tensor-core tiles (102 KiB): it runs the CUDA-core kernels there, with
// the same results, and keeps the tensor cores at head dim 64.
TEST(SimtAttention, AGpuWithLessSharedMemoryRunsTheCudaCoreKernelsAtHeadDim128) {
  struct Restore {
    size_t bytes = simt::shared_memory_per_block_optin();
    ~Restore() { simt::set_shared_memory_per_block_optin(bytes); }
  } restore;
  EXPECT_GT(kernels::attention_tensor_core_smem(128), size_t{99 * 1024});
  EXPECT_LE(kernels::attention_tensor_core_smem(64), size_t{99 * 1024});
  simt::set_shared_memory_per_block_optin(99 * 1024);
  EXPECT_FALSE(cuda::attention_uses_tensor_cores(-1, DType::BF16, 128));
  EXPECT_TRUE(cuda::attention_uses_tensor_cores(-1, DType::BF16, 64));
  check_case({1, 2, 1, 33, 128, DType::BF16});
  check_case({1, 2, 1, 65, 64, DType::BF16});
}

TEST(SimtAttention, CudaCoreKernelsMatchTheCpuBackendUnderEverySchedule) {
  check_case({1, 2, 1, 37, 64, DType::F32});
  check_case({1, 4, 2, 20, 40, DType::BF16});
  check_case({1, 2, 2, 9, 160, DType::F16});
}

}  // namespace
}  // namespace shardtrain
