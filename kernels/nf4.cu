// NF4 dequantization. The fast path gives each thread 8 code bytes (16 weights of one 64-weight
// block, so one absmax per thread) and writes them as 16-byte vectors; a scalar kernel covers
// unaligned operands and the tail. Products and sums use __fmul_rn/__fadd_rn so that nvcc does
// not contract them into FMAs: the results are the CPU backend's bits.
#include "common.cuh"
#include "nf4_kernels.h"
#include "shardtrain/backend/nf4_codebook.h"

namespace shardtrain::kernels {

namespace {

constexpr int kWeightsPerThread = 16;  // 8 bytes of codes

// Both code books, passed by value (1088 bytes of kernel parameters).
struct Nf4Tables {
  float code[16];
  float absmax_map[256];
};

__device__ __forceinline__ float block_absmax(const uint8_t* absmax_q, const float* absmax_scale,
                                              float offset, int64_t block, const float* map) {
  const float scaled = __fmul_rn(map[absmax_q[block]], absmax_scale[block / nf4::kAbsmaxGroupSize]);
  return __fadd_rn(scaled, offset);
}

template <typename T>
__global__ void nf4_vector_kernel(const uint2* codes, const uint8_t* absmax_q,
                                  const float* absmax_scale, float offset, T* out, int64_t groups,
                                  Nf4Tables tables) {
  __shared__ float code[16];
  __shared__ float map[256];
  for (int i = threadIdx.x; i < 256; i += blockDim.x) map[i] = tables.absmax_map[i];
  if (threadIdx.x < 16) code[threadIdx.x] = tables.code[threadIdx.x];
  __syncthreads();
  constexpr int N = kVec<T>;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t first = g * kWeightsPerThread;
    const float absmax =
        block_absmax(absmax_q, absmax_scale, offset, first / nf4::kNf4BlockSize, map);
    const uint2 packed = codes[g];
    float v[kWeightsPerThread];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      // Little-endian: byte k of the 8 lies in bits 8k.. of the pair of words.
      const unsigned word = k < 4 ? packed.x : packed.y;
      const unsigned byte = (word >> (8 * (k % 4))) & 0xffu;
      v[2 * k] = __fmul_rn(code[byte >> 4], absmax);
      v[2 * k + 1] = __fmul_rn(code[byte & 0x0fu], absmax);
    }
#pragma unroll
    for (int s = 0; s < kWeightsPerThread; s += N) {
      float chunk[N];
#pragma unroll
      for (int i = 0; i < N; ++i) chunk[i] = v[s + i];
      store_vec<T, N>(out + first + s, chunk);
    }
  }
}

template <typename T>
__global__ void nf4_scalar_kernel(const uint8_t* codes, const uint8_t* absmax_q,
                                  const float* absmax_scale, float offset, T* out, int64_t begin,
                                  int64_t n, Nf4Tables tables) {
  for (int64_t i = begin + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float absmax =
        block_absmax(absmax_q, absmax_scale, offset, i / nf4::kNf4BlockSize, tables.absmax_map);
    const unsigned byte = codes[i / 2];
    const unsigned c = (i % 2 == 0) ? byte >> 4 : byte & 0x0fu;
    out[i] = from_float<T>(__fmul_rn(tables.code[c], absmax));
  }
}

Nf4Tables make_tables() {
  Nf4Tables t;
  for (int i = 0; i < 16; ++i) t.code[i] = nf4::kNf4Code[static_cast<size_t>(i)];
  const std::array<float, 256>& map = nf4::dynamic_map_8bit();
  for (int i = 0; i < 256; ++i) t.absmax_map[i] = map[static_cast<size_t>(i)];
  return t;
}

}  // namespace

void nf4_dequantize(const uint8_t* codes, const uint8_t* absmax_q, const float* absmax_scale,
                    float offset, void* out, DType out_type, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  static const Nf4Tables tables = make_tables();
  ST_DISPATCH_FLOAT(out_type, T, {
    T* o = static_cast<T*>(out);
    int64_t done = 0;
    const int64_t groups = n / kWeightsPerThread;
    if (groups > 0 && aligned(codes, 8) && aligned(out, 16)) {
      nf4_vector_kernel<T><<<grid_for(groups), kThreads, 0, stream>>>(
          reinterpret_cast<const uint2*>(codes), absmax_q, absmax_scale, offset, o, groups, tables);
      ST_CHECK_LAUNCH();
      done = groups * kWeightsPerThread;
    }
    if (done < n) {
      nf4_scalar_kernel<T><<<grid_for(n - done), kThreads, 0, stream>>>(
          codes, absmax_q, absmax_scale, offset, o, done, n, tables);
      ST_CHECK_LAUNCH();
    }
  });
}

}  // namespace shardtrain::kernels
