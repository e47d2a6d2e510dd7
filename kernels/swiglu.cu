// SwiGLU: out = silu(gate) * up, silu(x) = x * sigmoid(x), and its backward. Vectorised
// grid-stride loops; every element is read before it is written, so outputs may alias inputs.
#include "common.cuh"

namespace shardtrain::kernels {

namespace {

__device__ __forceinline__ float sigmoid(float x) {
  return 1.0f / (1.0f + expf(-x));
}

template <int N, typename T>
__global__ void swiglu_forward_kernel(const T* gate, const T* up, T* out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = first; i < n / N; i += stride) {
    float g[N], u[N];
    load_vec<T, N>(gate + i * N, g);
    load_vec<T, N>(up + i * N, u);
#pragma unroll
    for (int k = 0; k < N; ++k) g[k] = g[k] * sigmoid(g[k]) * u[k];
    store_vec<T, N>(out + i * N, g);
  }
  for (int64_t i = n / N * N + first; i < n; i += stride) {
    const float g = to_float(gate[i]);
    out[i] = from_float<T>(g * sigmoid(g) * to_float(up[i]));
  }
}

__device__ __forceinline__ void swiglu_grad(float d, float g, float u, float& dg, float& du) {
  const float s = sigmoid(g);
  const float silu = g * s;
  dg = d * u * s * (1.0f + g * (1.0f - s));  // d silu / d g = s * (1 + g * (1 - s))
  du = d * silu;
}

template <int N, typename T>
__global__ void swiglu_backward_kernel(const T* dout, const T* gate, const T* up, T* dgate, T* dup,
                                       int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = first; i < n / N; i += stride) {
    float d[N], g[N], u[N], dg[N], du[N];
    load_vec<T, N>(dout + i * N, d);
    load_vec<T, N>(gate + i * N, g);
    load_vec<T, N>(up + i * N, u);
#pragma unroll
    for (int k = 0; k < N; ++k) swiglu_grad(d[k], g[k], u[k], dg[k], du[k]);
    store_vec<T, N>(dgate + i * N, dg);
    store_vec<T, N>(dup + i * N, du);
  }
  for (int64_t i = n / N * N + first; i < n; i += stride) {
    float dg, du;
    swiglu_grad(to_float(dout[i]), to_float(gate[i]), to_float(up[i]), dg, du);
    dgate[i] = from_float<T>(dg);
    dup[i] = from_float<T>(du);
  }
}

}  // namespace

void swiglu_forward(const void* gate, const void* up, void* out, DType type, int64_t n,
                    cudaStream_t stream) {
  if (n <= 0) return;
  ST_DISPATCH_FLOAT(type, T, {
    const T* g = static_cast<const T*>(gate);
    const T* u = static_cast<const T*>(up);
    T* o = static_cast<T*>(out);
    constexpr int V = kVec<T>;
    if (aligned(g, 16) && aligned(u, 16) && aligned(o, 16))
      swiglu_forward_kernel<V><<<grid_for(n / V + 1), kThreads, 0, stream>>>(g, u, o, n);
    else
      swiglu_forward_kernel<1><<<grid_for(n), kThreads, 0, stream>>>(g, u, o, n);
    ST_CHECK_LAUNCH();
  });
}

void swiglu_backward(const void* dout, const void* gate, const void* up, void* dgate, void* dup,
                     DType type, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  ST_DISPATCH_FLOAT(type, T, {
    const T* d = static_cast<const T*>(dout);
    const T* g = static_cast<const T*>(gate);
    const T* u = static_cast<const T*>(up);
    T* dg = static_cast<T*>(dgate);
    T* du = static_cast<T*>(dup);
    constexpr int V = kVec<T>;
    if (aligned(d, 16) && aligned(g, 16) && aligned(u, 16) && aligned(dg, 16) && aligned(du, 16))
      swiglu_backward_kernel<V><<<grid_for(n / V + 1), kThreads, 0, stream>>>(d, g, u, dg, du, n);
    else
      swiglu_backward_kernel<1><<<grid_for(n), kThreads, 0, stream>>>(d, g, u, dg, du, n);
    ST_CHECK_LAUNCH();
  });
}

}  // namespace shardtrain::kernels
