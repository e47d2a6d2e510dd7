// RMSNorm forward and backward. One block per row; the row's sum of squares (forward) or dot
// product (backward) is a fixed-tree block reduction, so results are deterministic. The weight
// gradient is a two-stage column sum (common.cuh), computed before dx so that dx may share
// memory with dy.
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

// dx = rstd * w * dy - x * rstd^3 / H * sum(dy * w * x)
template <int N, typename T, typename TW>
__global__ void __launch_bounds__(kRowThreads)
    rmsnorm_backward_dx_kernel(const T* dy, const T* x, const TW* w, const float* rstd, T* dx,
                               int64_t hidden) {
  __shared__ float red[33];
  const int64_t row = blockIdx.x;
  const T* dyr = dy + row * hidden;
  const T* xr = x + row * hidden;
  T* dxr = dx + row * hidden;
  const int64_t nvec = hidden / N;
  float dot = 0.0f;
  for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
    float g[N], a[N];
    load_vec<T, N>(dyr + i * N, g);
    load_vec<T, N>(xr + i * N, a);
#pragma unroll
    for (int k = 0; k < N; ++k) dot += g[k] * to_float(w[i * N + k]) * a[k];
  }
  dot = block_sum(dot, red);
  const float rs = rstd[row];
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
        column_sum(NormWeightTerm<T>{pdy, px, rstd, hidden}, rows, hidden, dw, scratch, stream);
        if (can_vectorize<T>(hidden, {pdy, px, pdx}))
          rmsnorm_backward_dx_kernel<kVec<T>>
              <<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(pdy, px, pw, rstd, pdx,
                                                                        hidden);
        else
          rmsnorm_backward_dx_kernel<1><<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(
              pdy, px, pw, rstd, pdx, hidden);
        ST_CHECK_LAUNCH();
      }));
}

}  // namespace shardtrain::kernels
