// AdamW on fp32 parameters and moments with a gradient of any float dtype; one launch per
// tensor, four elements per thread per step when every operand allows 16-byte (f32) accesses.
// Per-element arithmetic follows the CPU backend operation for operation, each product, sum and
// quotient rounded on its own (the _rn intrinsics keep nvcc from contracting them into fused
// multiply-adds), so both backends produce the same bits.
#include "common.cuh"

namespace shardtrain::kernels {

namespace {

__device__ __forceinline__ void adamw_element(float& p, float g, float& m, float& v,
                                              const AdamWConstants& c) {
  // m = beta1 m + (1-beta1) g ;  v = beta2 v + ((1-beta2) g) g
  const float mi = __fadd_rn(__fmul_rn(c.beta1, m), __fmul_rn(c.one_minus_beta1, g));
  const float vi = __fadd_rn(__fmul_rn(c.beta2, v), __fmul_rn(__fmul_rn(c.one_minus_beta2, g), g));
  m = mi;
  v = vi;
  // p = p decay - step_size (m / (sqrt(v) / sqrt(bc2) + eps))
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), c.bias2_sqrt), c.eps);
  p = __fsub_rn(__fmul_rn(p, c.decay), __fmul_rn(c.step_size, __fdiv_rn(mi, denom)));
}

template <int N, typename TG>
__global__ void adamw_kernel(float* param, const TG* grad, float* m, float* v, int64_t n,
                             AdamWConstants c) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = first; i < n / N; i += stride) {
    float p[N], g[N], mm[N], vv[N];
    load_vec<float, N>(param + i * N, p);
    load_vec<TG, N>(grad + i * N, g);
    load_vec<float, N>(m + i * N, mm);
    load_vec<float, N>(v + i * N, vv);
#pragma unroll
    for (int k = 0; k < N; ++k) adamw_element(p[k], g[k], mm[k], vv[k], c);
    store_vec<float, N>(param + i * N, p);
    store_vec<float, N>(m + i * N, mm);
    store_vec<float, N>(v + i * N, vv);
  }
  for (int64_t i = n / N * N + first; i < n; i += stride)
    adamw_element(param[i], to_float(grad[i]), m[i], v[i], c);
}

}  // namespace

void adamw(float* param, const void* grad, DType tg, float* m, float* v, int64_t n,
           const AdamWConstants& c, cudaStream_t stream) {
  if (n <= 0) return;
  ST_DISPATCH_FLOAT(tg, TG, {
    const TG* g = static_cast<const TG*>(grad);
    if (aligned(param, 16) && aligned(m, 16) && aligned(v, 16) && aligned(g, 4 * sizeof(TG)))
      adamw_kernel<4><<<grid_for(n / 4 + 1), kThreads, 0, stream>>>(param, g, m, v, n, c);
    else
      adamw_kernel<1><<<grid_for(n), kThreads, 0, stream>>>(param, g, m, v, n, c);
    ST_CHECK_LAUNCH();
  });
}

}  // namespace shardtrain::kernels
