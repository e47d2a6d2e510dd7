// Rotary position embedding, Hugging Face rotate-half convention. A thread rotates a vector of
// consecutive pairs (i, i + D/2), or one pair when the head dim or the pointers do not allow
// vectors. The inverse frequencies come from rope_inverse_frequencies() on the host, the
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

// A thread rotates N consecutive pairs (i .. i + N - 1 with their partners at + D/2), loading
// each half with one vector access. Index is the integer type of the element arithmetic: 32-bit
// whenever the tensor allows, because the row and position of an element take two divisions,
// and a 64-bit division is a call of a few dozen instructions where a 32-bit one is a handful.
template <int N, typename Index, typename T>
__global__ void rope_kernel(const T* x, T* out, Index rows, Index S, Index H, Index D, float theta,
                            int64_t position_offset, float sign, const InvFreqTable table,
                            const float* __restrict__ device_table) {
  __shared__ float inv_freq_s[kMaxTableHalf];
  const Index half = D / 2;
  const bool from_table = half <= kMaxTableHalf;
  if (from_table)
    for (Index i = threadIdx.x; i < half; i += blockDim.x) inv_freq_s[i] = table.v[i];
  __syncthreads();
  const Index vectors = half / N;  // of one half row
  const Index total = rows * vectors;
  for (Index idx = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<Index>(gridDim.x) * blockDim.x) {
    const Index r = idx / vectors, i0 = (idx - r * vectors) * N;
    const float pos = static_cast<float>(position_offset + static_cast<int64_t>((r / H) % S));
    const Index lo = r * D + i0, hi = lo + half;
    // Both halves are read before either is written, so out may alias x.
    float a[N], b[N];
    load_vec<T, N>(x + lo, a);
    load_vec<T, N>(x + hi, b);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const Index i = i0 + k;
      const float inv_freq =
          from_table ? inv_freq_s[i]
          : device_table != nullptr
              ? device_table[i]
              : 1.0f / powf(theta, static_cast<float>(2 * i) / static_cast<float>(D));
      float sn, cs;
      sincosf(pos * inv_freq, &sn, &cs);
      sn *= sign;
      const float rotated_a = a[k] * cs - b[k] * sn;
      b[k] = b[k] * cs + a[k] * sn;
      a[k] = rotated_a;
    }
    store_vec<T, N>(out + lo, a);
    store_vec<T, N>(out + hi, b);
  }
}

template <int N, typename Index, typename T>
void launch_rope(const T* x, T* out, int64_t rows, int64_t S, int64_t H, int64_t D,
                 const RopeParams& params, int64_t position_offset, bool inverse,
                 const InvFreqTable& table, const float* device_table, cudaStream_t stream) {
  rope_kernel<N, Index, T><<<grid_for(rows * (D / 2) / N), kThreads, 0, stream>>>(
      x, out, static_cast<Index>(rows), static_cast<Index>(S), static_cast<Index>(H),
      static_cast<Index>(D), params.theta, position_offset, inverse ? -1.0f : 1.0f, table,
      device_table);
  ST_CHECK_LAUNCH();
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
  // Element indices reach rows * D; the loop's grid is at most grid_for(rows * D).
  const bool index32 = index32_fits(rows * D);
  ST_DISPATCH_FLOAT(type, T, {
    constexpr int kWide = kVec<T>;
    const T* px = static_cast<const T*>(x);
    T* pout = static_cast<T*>(out);
    const bool wide = D % 2 == 0 && half % kWide == 0 && aligned(px, sizeof(T) * kWide) &&
                      aligned(pout, sizeof(T) * kWide);
    if (wide && index32)
      launch_rope<kWide, uint32_t>(px, pout, rows, S, H, D, params, position_offset, inverse, table,
                                   device_table, stream);
    else if (wide)
      launch_rope<kWide, int64_t>(px, pout, rows, S, H, D, params, position_offset, inverse, table,
                                  device_table, stream);
    else if (index32)
      launch_rope<1, uint32_t>(px, pout, rows, S, H, D, params, position_offset, inverse, table,
                               device_table, stream);
    else
      launch_rope<1, int64_t>(px, pout, rows, S, H, D, params, position_offset, inverse, table,
                              device_table, stream);
  });
}

}  // namespace shardtrain::kernels
