// RMSNorm forward and backward. The forward runs a block per row; the backward a block per run
// of consecutive rows, which also sums the weight gradient of its rows while it has them in
// hand. Every sum has a fixed order (fixed-tree block reductions, rows in order, the blocks'
// partial weight gradients added in order), so results are deterministic and the same on every
// GPU model.
#include "common.cuh"

namespace shardtrain::kernels {

namespace {

constexpr int kRowThreads = 256;

template <int N, typename T, typename TW>
__global__ void __launch_bounds__(kRowThreads)
    rmsnorm_forward_kernel(const T* x, const TW* w, float eps, T* y, float* rstd, int64_t hidden) {
  __shared__ float red[33];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * hidden;
  T* yr = y + row * hidden;
  const int64_t nvec = hidden / N;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
    float v[N];
    load_vec<T, N>(xr + i * N, v);
#pragma unroll
    for (int k = 0; k < N; ++k) ss += v[k] * v[k];
  }
  ss = block_sum(ss, red);
  const float rs =
      static_cast<float>(1.0 / sqrt(static_cast<double>(ss) / static_cast<double>(hidden) + eps));
  if (threadIdx.x == 0) rstd[row] = rs;
  for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
    float v[N];
    load_vec<T, N>(xr + i * N, v);
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = v[k] * rs * to_float(w[i * N + k]);
    store_vec<T, N>(yr + i * N, v);
  }
}

// dx = rstd * w * dy - x * rstd^3 / H * sum(dy * w * x), and dw = sum over rows of dy * x * rstd.
//
// A block takes `rows_per_block` consecutive rows, one after another. With kSumDw it adds each
// row's dy * x * rstd into a weight-gradient row of its own in shared memory, and at the end
// writes that row to `dw_partial[blockIdx.x]`; column_finish_kernel then adds the blocks' rows in
// order. So dy and x are read from memory once for both gradients (a separate column-sum pass
// would read them again: 5 tensor-sized transfers instead of 3). A thread owns the same columns
// in every row, so the shared row needs no synchronisation; it is laid out [N][hidden / N] so
// that the threads of a warp, which own consecutive vectors, hit consecutive banks. Without
// kSumDw (rows too wide for that row, whose dw comes from column sums) a block takes one row.
template <int N, typename T, typename TW, bool kSumDw>
__global__ void __launch_bounds__(kRowThreads)
    rmsnorm_backward_kernel(const T* dy, const T* x, const TW* w, const float* rstd, T* dx,
                            float* dw_partial, int64_t rows, int64_t hidden,
                            int64_t rows_per_block) {
  extern __shared__ float dw_rows[];  // [N][nvec], with kSumDw
  __shared__ float red[33];
  const int64_t nvec = hidden / N;
  if constexpr (kSumDw)
    for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x)
#pragma unroll
      for (int k = 0; k < N; ++k) dw_rows[k * nvec + i] = 0.0f;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int64_t end = min(rows, first + rows_per_block);
  for (int64_t row = first; row < end; ++row) {
    const T* dyr = dy + row * hidden;
    const T* xr = x + row * hidden;
    T* dxr = dx + row * hidden;
    const float rs = rstd[row];
    float dot = 0.0f;
    for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
      float g[N], a[N];
      load_vec<T, N>(dyr + i * N, g);
      load_vec<T, N>(xr + i * N, a);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        dot += g[k] * to_float(w[i * N + k]) * a[k];
        if constexpr (kSumDw) dw_rows[k * nvec + i] += g[k] * a[k] * rs;
      }
    }
    dot = block_sum(dot, red);  // its barriers also order this row's reads before dx's writes
    const float coef = dot / static_cast<float>(hidden) * rs * rs * rs;
    // Each thread rewrites exactly the elements it read, so dx may alias dy.
    for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
      float g[N], a[N];
      load_vec<T, N>(dyr + i * N, g);
      load_vec<T, N>(xr + i * N, a);
#pragma unroll
      for (int k = 0; k < N; ++k) g[k] = rs * to_float(w[i * N + k]) * g[k] - a[k] * coef;
      store_vec<T, N>(dxr + i * N, g);
    }
  }
  if constexpr (kSumDw) {
    float* out = dw_partial + static_cast<int64_t>(blockIdx.x) * hidden;
    for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x)
#pragma unroll
      for (int k = 0; k < N; ++k) out[i * N + k] = dw_rows[k * nvec + i];
  }
}

template <typename T>
struct NormWeightTerm {
  const T* dy;
  const T* x;
  const float* rstd;
  int64_t cols;
  __device__ float operator()(int64_t r, int64_t c) const {
    return to_float(dy[r * cols + c]) * to_float(x[r * cols + c]) * rstd[r];
  }
};

// The fused backward's weight-gradient row lives in shared memory: up to 47 KiB (12032 columns),
// which with the block reduction's 132 bytes stays under the 48 KiB a kernel may take without
// opting in.
constexpr size_t kMaxDwRowBytes = 47 << 10;

// Blocks of the fused backward, from the row count alone (so the sums' order is the same on every
// GPU): runs of at least 16 rows, so that writing and reading back the blocks' fp32 partial rows
// adds at most a twelfth to the traffic of 16-bit dy, x and dx; at most 1024 blocks, about one
// wave of 256-thread blocks on an A100 or H100.
int64_t backward_blocks(int64_t rows) {
  constexpr int64_t kMinRowsPerBlock = 16, kMaxBlocks = 1024;
  return std::clamp<int64_t>((rows + kMinRowsPerBlock - 1) / kMinRowsPerBlock, 1, kMaxBlocks);
}

// Vector width for rows of `hidden` elements of T starting at the given pointers.
template <typename T>
bool can_vectorize(int64_t hidden, std::initializer_list<const void*> ptrs) {
  constexpr int n = kVec<T>;
  if (hidden % n != 0) return false;
  for (const void* p : ptrs)
    if (!aligned(p, n * sizeof(T))) return false;
  return true;
}

}  // namespace

void rmsnorm_forward(const void* x, DType type, const void* w, DType tw, float eps, void* y,
                     float* rstd, int64_t rows, int64_t hidden, cudaStream_t stream) {
  if (rows <= 0 || hidden <= 0) return;
  ST_DISPATCH_FLOAT(
      type, T, ST_DISPATCH_FLOAT(tw, TW, {
        const T* px = static_cast<const T*>(x);
        const TW* pw = static_cast<const TW*>(w);
        T* py = static_cast<T*>(y);
        if (can_vectorize<T>(hidden, {px, py}))
          rmsnorm_forward_kernel<kVec<T>><<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(
              px, pw, eps, py, rstd, hidden);
        else
          rmsnorm_forward_kernel<1><<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(
              px, pw, eps, py, rstd, hidden);
        ST_CHECK_LAUNCH();
      }));
}

void rmsnorm_backward(const void* dy, const void* x, DType type, const void* w, DType tw,
                      const float* rstd, void* dx, float* dw, int64_t rows, int64_t hidden,
                      Scratch& scratch, cudaStream_t stream) {
  if (rows <= 0 || hidden <= 0) return;
  ST_DISPATCH_FLOAT(
      type, T, ST_DISPATCH_FLOAT(tw, TW, {
        const T* pdy = static_cast<const T*>(dy);
        const T* px = static_cast<const T*>(x);
        const TW* pw = static_cast<const TW*>(w);
        T* pdx = static_cast<T*>(dx);
        const bool vectorize = can_vectorize<T>(hidden, {pdy, px, pdx});
        const size_t dw_row_bytes = sizeof(float) * static_cast<size_t>(hidden);
        if (dw_row_bytes <= kMaxDwRowBytes) {
          const int64_t blocks = backward_blocks(rows);
          const int64_t rows_per_block = (rows + blocks - 1) / blocks;
          float* partial = static_cast<float*>(scratch.get(dw_row_bytes * blocks));
          auto kernel = vectorize ? rmsnorm_backward_kernel<kVec<T>, T, TW, true>
                                  : rmsnorm_backward_kernel<1, T, TW, true>;
          kernel<<<static_cast<unsigned>(blocks), kRowThreads, dw_row_bytes, stream>>>(
              pdy, px, pw, rstd, pdx, partial, rows, hidden, rows_per_block);
          ST_CHECK_LAUNCH();
          column_finish_kernel<>
              <<<ceil_div(hidden, kThreads), kThreads, 0, stream>>>(partial, blocks, hidden, dw);
          ST_CHECK_LAUNCH();
          return;
        }
        // Too wide: dw by column sums first (so that dx may share memory with dy), then dx with
        // a block per row.
        column_sum(NormWeightTerm<T>{pdy, px, rstd, hidden}, rows, hidden, dw, scratch, stream);
        auto kernel = vectorize ? rmsnorm_backward_kernel<kVec<T>, T, TW, false>
                                : rmsnorm_backward_kernel<1, T, TW, false>;
        kernel<<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(pdy, px, pw, rstd, pdx,
                                                                        nullptr, rows, hidden, 1);
        ST_CHECK_LAUNCH();
      }));
}

}  // namespace shardtrain::kernels
