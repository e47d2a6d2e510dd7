// Rotary position embedding, Hugging Face rotate-half convention. One thread per rotated pair
// (i, i + D/2). The inverse frequencies come from rope_inverse_frequencies() on the host, the
// function the CPU backend uses (the host libm's powf, Llama-3 scaling), so both backends rotate
// by the same fp32 angle position * inv_freq; a device powf differs from the host's by an ulp or
// two, which at position 300 already moves the angle by 1e-5 radians.
#include <cmath>
#include <vector>

#include "common.cuh"

namespace shardtrain::kernels {

namespace {

// Up to D = 1024 the frequencies travel as a kernel parameter (2 KiB). Larger head dims read
// them from device memory when they are Llama-3 scaled, and otherwise compute the unscaled
// 1 / theta^(2i/D) on the device (equal to the CPU's to an ulp or two).
constexpr int64_t kMaxTableHalf = 512;
struct InvFreqTable {
  float v[kMaxTableHalf];
};

template <typename T>
__global__ void rope_kernel(const T* x, T* out, int64_t rows, int64_t S, int64_t H, int64_t D,
                            float theta, int64_t position_offset, float sign,
                            const InvFreqTable table, const float* __restrict__ device_table) {
  __shared__ float inv_freq_s[kMaxTableHalf];
  const int64_t half = D / 2;
  const bool from_table = half <= kMaxTableHalf;
  if (from_table)
    for (int64_t i = threadIdx.x; i < half; i += blockDim.x) inv_freq_s[i] = table.v[i];
  __syncthreads();
  const int64_t total = rows * half;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / half, i = idx - r * half;
    const int64_t s = (r / H) % S;
    const float pos = static_cast<float>(position_offset + s);
    const float inv_freq =
        from_table ? inv_freq_s[i]
        : device_table != nullptr
            ? device_table[i]
            : 1.0f / powf(theta, static_cast<float>(2 * i) / static_cast<float>(D));
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
          const RopeParams& params, int64_t position_offset, bool inverse, Scratch& scratch,
          cudaStream_t stream) {
  const int64_t rows = B * S * H;
  if (rows <= 0 || D < 2) return;
  InvFreqTable table{};
  const float* device_table = nullptr;
  const int64_t half = D / 2;
  if (half <= kMaxTableHalf || params.llama3) {
    const std::vector<float> inv_freq = rope_inverse_frequencies(D, params);
    if (half <= kMaxTableHalf) {
      for (int64_t i = 0; i < half; ++i) table.v[i] = inv_freq[static_cast<size_t>(i)];
    } else {
      // A pageable source: the copy has taken the values when cudaMemcpyAsync returns.
      const size_t bytes = inv_freq.size() * sizeof(float);
      void* dst = scratch.get(bytes);
      ST_CUDA_CHECK(cudaMemcpyAsync(dst, inv_freq.data(), bytes, cudaMemcpyHostToDevice, stream));
      device_table = static_cast<const float*>(dst);
    }
  }
  ST_DISPATCH_FLOAT(type, T, {
    rope_kernel<T><<<grid_for(rows * half), kThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<T*>(out), rows, S, H, D, params.theta,
        position_offset, inverse ? -1.0f : 1.0f, table, device_table);
    ST_CHECK_LAUNCH();
  });
}

}  // namespace shardtrain::kernels
