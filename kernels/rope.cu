// Rotary position embedding, Hugging Face rotate-half convention. One thread per rotated pair
// (i, i + D/2); the angle is formed in fp32 exactly as the CPU backend forms it
// (inv_freq = 1 / theta^(2i/D), angle = position * inv_freq) so both agree to rounding.
#include "common.cuh"

namespace shardtrain::kernels {

namespace {

template <typename T>
__global__ void rope_kernel(const T* x, T* out, int64_t rows, int64_t S, int64_t H, int64_t D,
                            float theta, int64_t position_offset, float sign) {
  const int64_t half = D / 2;
  const int64_t total = rows * half;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / half, i = idx - r * half;
    const int64_t s = (r / H) % S;
    const float pos = static_cast<float>(position_offset + s);
    const float inv_freq = 1.0f / powf(theta, static_cast<float>(2 * i) / static_cast<float>(D));
    float sn, cs;
    sincosf(pos * inv_freq, &sn, &cs);
    sn *= sign;
    const int64_t lo = r * D + i, hi = lo + half;
    // Both halves are read before either is written, so out may alias x.
    const float a = to_float(x[lo]), b = to_float(x[hi]);
    out[lo] = from_float<T>(a * cs - b * sn);
    out[hi] = from_float<T>(b * cs + a * sn);
  }
}

}  // namespace

void rope(const void* x, void* out, DType type, int64_t B, int64_t S, int64_t H, int64_t D,
          float theta, int64_t position_offset, bool inverse, cudaStream_t stream) {
  const int64_t rows = B * S * H;
  if (rows <= 0 || D < 2) return;
  ST_DISPATCH_FLOAT(type, T, {
    rope_kernel<T><<<grid_for(rows * (D / 2)), kThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<T*>(out), rows, S, H, D, theta, position_offset,
        inverse ? -1.0f : 1.0f);
    ST_CHECK_LAUNCH();
  });
}

}  // namespace shardtrain::kernels
