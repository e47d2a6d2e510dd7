// Device-side helpers shared by the kernels: dtype conversion, aligned vector access, warp and
// block reductions, launch helpers and dtype dispatch.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels.h"
#include "shardtrain/backend/cuda.h"
#include "shardtrain/core/error.h"

namespace shardtrain::kernels {

using bf16 = __nv_bfloat16;
using f16 = __half;

// ---- scalar conversion (round to nearest even into 16-bit types) ----------------------------

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ float to_float<bf16>(bf16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float to_float<f16>(f16 v) {
  return __half2float(v);
}

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ bf16 from_float<bf16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ f16 from_float<f16>(float v) {
  return __float2half_rn(v);
}

// The DType that names a device element type (host side, for dispatching lists of tensors).
template <typename T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
  return DType::F32;
}
template <>
constexpr DType dtype_of<bf16>() {
  return DType::BF16;
}
template <>
constexpr DType dtype_of<f16>() {
  return DType::F16;
}

// ---- vector access --------------------------------------------------------------------------

// N elements of T loaded or stored with one instruction (N * sizeof(T) <= 16, a power of two).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ void load_vec(const T* p, float (&out)[N]) {
  const Vec<T, N> x = *reinterpret_cast<const Vec<T, N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_float(x.v[i]);
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* p, const float (&in)[N]) {
  Vec<T, N> x;
#pragma unroll
  for (int i = 0; i < N; ++i) x.v[i] = from_float<T>(in[i]);
  *reinterpret_cast<Vec<T, N>*>(p) = x;
}

// Elements per 16-byte vector of T, capped at 8.
template <typename T>
constexpr int kVec = 16 / sizeof(T) > 8 ? 8 : static_cast<int>(16 / sizeof(T));

inline bool aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// ---- multi-tensor lists ----------------------------------------------------------------------

// A multi-tensor launch takes up to kListMax tensors, their pointers passed by value in the
// kernel's arguments (under the 4 KB limit), so a launch needs no device-side table and no copy
// before it. Tensor t of a list is worked on by blocks first_block[t] .. first_block[t + 1] - 1.
constexpr int kListMax = 48;

// The tensor of a list that this block works on.
__device__ __forceinline__ int list_tensor(const int64_t (&first_block)[kListMax + 1]) {
  int t = 0;
  while (blockIdx.x >= first_block[t + 1]) ++t;
  return t;
}

// ---- reductions -----------------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename T>
__device__ __forceinline__ T warp_max(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32), returned to every thread. The tree is fixed,
// so the result is deterministic. `smem` holds 33 values; calls may follow each other.
template <typename T>
__device__ __forceinline__ T block_sum(T v, T* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  __syncthreads();  // a previous call may still be reading smem[32]
  v = warp_sum(v);
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T r = lane < warps ? smem[lane] : T(0);
    r = warp_sum(r);
    if (lane == 0) smem[32] = r;
  }
  __syncthreads();
  return smem[32];
}

template <typename T>
__device__ __forceinline__ T block_max(T v, T* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  __syncthreads();
  v = warp_max(v);
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T r = lane < warps ? smem[lane] : smem[0];
    r = warp_max(r);
    if (lane == 0) smem[32] = r;
  }
  __syncthreads();
  return smem[32];
}

// ---- launching ------------------------------------------------------------------------------

constexpr int kThreads = 256;

// Blocks for a grid-stride loop over `items` with `threads` per block: enough to fill the device
// a few times over, never more than the items need.
inline unsigned grid_for(int64_t items, int threads = kThreads) {
  const int64_t needed = (items + threads - 1) / threads;
  const int64_t cap = static_cast<int64_t>(cuda::multiprocessor_count(-1)) * 16;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(needed, cap)));
}

// Whether a grid-stride loop over `items` (on the grid grid_for(items) or a smaller one) may
// count in 32 bits: every index, and the step past the last one, stay below 2^31. Kernels that
// divide their loop index take a 32-bit index type when it may: a 64-bit division is a call of a
// few dozen instructions, a 32-bit one a handful.
inline bool index32_fits(int64_t items) {
  return items + static_cast<int64_t>(grid_for(items)) * kThreads <= INT32_MAX;
}

inline unsigned ceil_div(int64_t a, int64_t b) {
  return static_cast<unsigned>((a + b - 1) / b);
}

}  // namespace shardtrain::kernels

#define ST_CHECK_LAUNCH() ST_CUDA_CHECK(cudaGetLastError())

// Runs the statement list with T bound to the storage type of a float dtype.
#define ST_DISPATCH_FLOAT(dtype, T, ...)                                                  \
  switch (dtype) {                                                                        \
    case ::shardtrain::DType::F32: {                                                      \
      using T = float;                                                                    \
      __VA_ARGS__;                                                                        \
    } break;                                                                              \
    case ::shardtrain::DType::BF16: {                                                     \
      using T = ::shardtrain::kernels::bf16;                                              \
      __VA_ARGS__;                                                                        \
    } break;                                                                              \
    case ::shardtrain::DType::F16: {                                                      \
      using T = ::shardtrain::kernels::f16;                                               \
      __VA_ARGS__;                                                                        \
    } break;                                                                              \
    default:                                                                              \
      throw ::shardtrain::ShapeError(::shardtrain::detail::concat(                        \
          "CUDA kernel needs a float tensor (f32, bf16, f16), got ", dtype_name(dtype))); \
  }

namespace shardtrain::kernels {

// ---- deterministic column sums --------------------------------------------------------------
//
// out[c] += sum_r term(r, c) over a [rows, cols] problem, in two stages with a fixed order: stage
// one sums fixed row ranges per column into partials (32 columns x 8 row lanes per block, lanes
// combined in order), stage two adds the partials of each column in order. The split depends
// only on the shape, so results are reproducible run to run and across GPU models.

constexpr int kColumnTile = 32;
constexpr int kRowLanes = 8;

inline int64_t column_sum_splits(int64_t rows) {
  const int64_t splits = (rows + 255) / 256;
  return std::max<int64_t>(1, std::min<int64_t>(splits, 512));
}

template <typename Term>
__global__ void column_partial_kernel(Term term, int64_t rows, int64_t cols, int64_t rows_per_split,
                                      float* partial) {
  __shared__ float lanes[kRowLanes][kColumnTile + 1];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColumnTile + threadIdx.x;
  const int64_t split = blockIdx.y;
  const int64_t r0 = split * rows_per_split;
  const int64_t r1 = min(rows, r0 + rows_per_split);
  float acc = 0.0f;
  if (c < cols)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kRowLanes) acc += term(r, c);
  lanes[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float total = 0.0f;
#pragma unroll
    for (int i = 0; i < kRowLanes; ++i) total += lanes[i][threadIdx.x];
    partial[split * cols + c] = total;
  }
}

// A template only so that every file that includes this header may instantiate it.
template <int kUnused = 0>
__global__ void column_finish_kernel(const float* partial, int64_t splits, int64_t cols,
                                     float* out) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float total = 0.0f;
  for (int64_t s = 0; s < splits; ++s) total += partial[s * cols + c];
  out[c] += total;
}

template <typename Term>
void column_sum(Term term, int64_t rows, int64_t cols, float* out, Scratch& scratch,
                cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  const int64_t splits = column_sum_splits(rows);
  const int64_t rows_per_split = (rows + splits - 1) / splits;
  float* partial = static_cast<float*>(scratch.get(sizeof(float) * splits * cols));
  const dim3 grid(ceil_div(cols, kColumnTile), static_cast<unsigned>(splits));
  column_partial_kernel<<<grid, dim3(kColumnTile, kRowLanes), 0, stream>>>(term, rows, cols,
                                                                           rows_per_split, partial);
  ST_CHECK_LAUNCH();
  column_finish_kernel<>
      <<<ceil_div(cols, kThreads), kThreads, 0, stream>>>(partial, splits, cols, out);
  ST_CHECK_LAUNCH();
}

}  // namespace shardtrain::kernels
