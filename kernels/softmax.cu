// Causal softmax over explicit score blocks and its backward: one warp per row, every lane
// owning the same columns in every pass (so outputs may alias inputs).
#include "common.cuh"

namespace shardtrain::kernels {

namespace {

constexpr int kWarpsPerBlock = 8;

template <typename T>
__global__ void causal_softmax_kernel(const T* scores, T* probs, int64_t rows, int64_t sq,
                                      int64_t sk, float scale) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const int64_t q = row % sq;
  // Keys [0, valid) are visible to this query; the rest get probability 0.
  const int64_t valid = min(max(q + (sk - sq) + 1, int64_t{0}), sk);
  const T* in = scores + row * sk;
  T* out = probs + row * sk;
  float mx = -INFINITY;
  for (int64_t j = lane; j < valid; j += 32) mx = fmaxf(mx, scale * to_float(in[j]));
  mx = warp_max(mx);
  float total = 0.0f;
  for (int64_t j = lane; j < valid; j += 32) total += expf(scale * to_float(in[j]) - mx);
  total = warp_sum(total);
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  for (int64_t j = lane; j < sk; j += 32)
    out[j] = from_float<T>(j < valid ? expf(scale * to_float(in[j]) - mx) * inv : 0.0f);
}

template <typename T>
__global__ void causal_softmax_backward_kernel(const T* probs, const T* dprobs, T* dscores,
                                               int64_t rows, int64_t sk, float scale) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const T* p = probs + row * sk;
  const T* d = dprobs + row * sk;
  T* out = dscores + row * sk;
  float dot = 0.0f;
  for (int64_t j = lane; j < sk; j += 32) dot += to_float(p[j]) * to_float(d[j]);
  dot = warp_sum(dot);
  for (int64_t j = lane; j < sk; j += 32)
    out[j] = from_float<T>(scale * to_float(p[j]) * (to_float(d[j]) - dot));
}

}  // namespace

void causal_softmax(const void* scores, void* probs, DType type, int64_t rows, int64_t sq,
                    int64_t sk, float scale, cudaStream_t stream) {
  if (rows <= 0 || sk <= 0) return;
  ST_DISPATCH_FLOAT(type, T, {
    causal_softmax_kernel<T><<<ceil_div(rows, kWarpsPerBlock), 32 * kWarpsPerBlock, 0, stream>>>(
        static_cast<const T*>(scores), static_cast<T*>(probs), rows, sq, sk, scale);
    ST_CHECK_LAUNCH();
  });
}

void causal_softmax_backward(const void* probs, const void* dprobs, void* dscores, DType type,
                             int64_t rows, int64_t sk, float scale, cudaStream_t stream) {
  if (rows <= 0 || sk <= 0) return;
  ST_DISPATCH_FLOAT(type, T, {
    causal_softmax_backward_kernel<T>
        <<<ceil_div(rows, kWarpsPerBlock), 32 * kWarpsPerBlock, 0, stream>>>(
            static_cast<const T*>(probs), static_cast<const T*>(dprobs), static_cast<T*>(dscores),
            rows, sk, scale);
    ST_CHECK_LAUNCH();
  });
}

}  // namespace shardtrain::kernels
