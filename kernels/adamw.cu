// AdamW on fp32 parameters and moments with a gradient of any float dtype, for a list of tensors
// in a few launches (the multi-tensor apply of fused optimizers: a model's hundreds of small
// launches become a handful; a single tensor is a list of one). Four elements per thread per
// step when every operand allows 16-byte (f32) accesses.
// Per-element arithmetic follows the CPU backend operation for operation, each product, sum and
// quotient rounded on its own (the _rn intrinsics keep nvcc from contracting them into fused
// multiply-adds), so both backends produce the same bits.
#include "common.cuh"

namespace shardtrain::kernels {

namespace {

__device__ __forceinline__ void adamw_element(float& p, float g, float& m, float& v,
                                              const AdamWConstants& c) {
  // g = grad_scale g ;  m = beta1 m + (1-beta1) g ;  v = beta2 v + ((1-beta2) g) g
  g = __fmul_rn(g, c.grad_scale);
  const float mi = __fadd_rn(__fmul_rn(c.beta1, m), __fmul_rn(c.one_minus_beta1, g));
  const float vi = __fadd_rn(__fmul_rn(c.beta2, v), __fmul_rn(__fmul_rn(c.one_minus_beta2, g), g));
  m = mi;
  v = vi;
  // p = p decay - step_size (m / (sqrt(v) / sqrt(bc2) + eps))
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), c.bias2_sqrt), c.eps);
  p = __fsub_rn(__fmul_rn(p, c.decay), __fmul_rn(c.step_size, __fdiv_rn(mi, denom)));
}

// Elements per block: a multiple of 4, so every chunk starts as aligned as its tensor.
constexpr int64_t kChunkElems = 32768;

template <typename TG>
struct AdamWList {
  float* param[kListMax];
  const TG* grad[kListMax];
  float* m[kListMax];
  float* v[kListMax];
  int64_t n[kListMax];
  float decay[kListMax];
  int64_t first_block[kListMax + 1];  // as list_tensor (common.cuh) reads it
  int count;
};

template <int N, typename TG>
__global__ void adamw_multi_kernel(const AdamWList<TG> list, AdamWConstants c) {
  const int64_t block = blockIdx.x;
  const int t = list_tensor(list.first_block);
  const int64_t lo = (block - list.first_block[t]) * kChunkElems;
  const int64_t len = min(kChunkElems, list.n[t] - lo);
  c.decay = list.decay[t];
  float* param = list.param[t] + lo;
  const TG* grad = list.grad[t] + lo;
  float* m = list.m[t] + lo;
  float* v = list.v[t] + lo;
  for (int64_t i = threadIdx.x; i < len / N; i += blockDim.x) {
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
  for (int64_t i = len / N * N + threadIdx.x; i < len; i += blockDim.x)
    adamw_element(param[i], to_float(grad[i]), m[i], v[i], c);
}

template <typename TG>
bool adamw_vectorizable(const float* param, const TG* grad, const float* m, const float* v) {
  return aligned(param, 16) && aligned(m, 16) && aligned(v, 16) && aligned(grad, 4 * sizeof(TG));
}

// Launches the tensors of `refs` whose gradient is TG and whose alignment allows (or, with
// `vectorized` false, does not allow) the 4-wide path, kListMax at a time.
template <typename TG>
void launch_adamw_lists(const AdamWTensorRef* refs, int64_t count, bool vectorized,
                        const AdamWConstants& c, cudaStream_t stream) {
  AdamWList<TG> list{};
  int64_t blocks = 0;
  auto launch = [&] {
    if (list.count == 0) return;
    list.first_block[list.count] = blocks;
    if (vectorized)
      adamw_multi_kernel<4, TG><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(list, c);
    else
      adamw_multi_kernel<1, TG><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(list, c);
    ST_CHECK_LAUNCH();
    list = AdamWList<TG>{};
    blocks = 0;
  };
  for (int64_t i = 0; i < count; ++i) {
    const AdamWTensorRef& r = refs[i];
    const TG* grad = static_cast<const TG*>(r.grad);
    if (r.n <= 0 || dtype_of<TG>() != r.grad_type ||
        adamw_vectorizable(r.param, grad, r.m, r.v) != vectorized)
      continue;
    const int k = list.count++;
    list.param[k] = r.param;
    list.grad[k] = grad;
    list.m[k] = r.m;
    list.v[k] = r.v;
    list.n[k] = r.n;
    list.decay[k] = r.decay;
    list.first_block[k] = blocks;
    blocks += (r.n + kChunkElems - 1) / kChunkElems;
    if (list.count == kListMax) launch();
  }
  launch();
}

}  // namespace

void adamw_multi(const AdamWTensorRef* tensors, int64_t count, const AdamWConstants& c,
                 cudaStream_t stream) {
  for (bool vectorized : {true, false}) {
    launch_adamw_lists<float>(tensors, count, vectorized, c, stream);
    launch_adamw_lists<bf16>(tensors, count, vectorized, c, stream);
    launch_adamw_lists<f16>(tensors, count, vectorized, c, stream);
  }
}

}  // namespace shardtrain::kernels
