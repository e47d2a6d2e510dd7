// Whole-tensor sums in fp64 and the fused unscale + inf/nan check.
//
// Sums are deterministic: the grid size depends only on the element count, each thread walks a
// fixed grid-stride sequence, blocks reduce with a fixed tree, and one final block adds the
// block partials in a fixed tree as well.
#include "common.cuh"

namespace shardtrain::kernels {

namespace {

constexpr int kSumThreads = 256;
constexpr int64_t kMaxSumBlocks = 1024;

template <int N, typename T, bool kSquares>
__global__ void __launch_bounds__(kSumThreads)
    partial_sum_kernel(const T* x, int64_t n, double* partial) {
  __shared__ double red[33];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  double acc = 0.0;
  for (int64_t i = first; i < n / N; i += stride) {
    float v[N];
    load_vec<T, N>(x + i * N, v);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const double d = v[k];
      acc += kSquares ? d * d : d;
    }
  }
  for (int64_t i = n / N * N + first; i < n; i += stride) {
    const double d = to_float(x[i]);
    acc += kSquares ? d * d : d;
  }
  acc = block_sum(acc, red);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

__global__ void __launch_bounds__(kMaxSumBlocks)
    final_sum_kernel(const double* partial, int64_t blocks, double* result) {
  __shared__ double red[33];
  double acc = threadIdx.x < blocks ? partial[threadIdx.x] : 0.0;
  acc = block_sum(acc, red);
  if (threadIdx.x == 0) *result = acc;
}

template <int N, typename T>
__global__ void unscale_kernel(T* x, int64_t n, float inv_scale, int* found) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  bool bad = false;
  for (int64_t i = first; i < n / N; i += stride) {
    float v[N];
    load_vec<T, N>(x + i * N, v);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      bad = bad || !isfinite(v[k]);
      v[k] *= inv_scale;
    }
    store_vec<T, N>(x + i * N, v);
  }
  for (int64_t i = n / N * N + first; i < n; i += stride) {
    const float v = to_float(x[i]);
    bad = bad || !isfinite(v);
    x[i] = from_float<T>(v * inv_scale);
  }
  if (__any_sync(0xffffffffu, bad) && (threadIdx.x & 31) == 0) *found = 1;
}

// Enqueues the sum of x (or of its squares) into *result, using `partial` (kMaxSumBlocks
// doubles) for the block partials. The grid depends only on n, and the split of elements among
// threads on n and on whether x is 16-byte aligned (vector or scalar loads), so the same values
// at an equally aligned address always give the same bits; a copy at another alignment may
// differ in the last bits of the double.
void enqueue_sum(const void* x, DType type, int64_t n, bool squares, double* partial,
                 double* result, cudaStream_t stream) {
  if (n <= 0) {
    ST_CUDA_CHECK(cudaMemsetAsync(result, 0, sizeof(double), stream));
    return;
  }
  const int64_t blocks =
      std::min<int64_t>(kMaxSumBlocks, (n + kSumThreads * 8 - 1) / (kSumThreads * 8));
  ST_DISPATCH_FLOAT(type, T, {
    const T* p = static_cast<const T*>(x);
    constexpr int V = kVec<T>;
    const bool vec = aligned(p, 16);
    if (squares) {
      if (vec)
        partial_sum_kernel<V, T, true><<<blocks, kSumThreads, 0, stream>>>(p, n, partial);
      else
        partial_sum_kernel<1, T, true><<<blocks, kSumThreads, 0, stream>>>(p, n, partial);
    } else {
      if (vec)
        partial_sum_kernel<V, T, false><<<blocks, kSumThreads, 0, stream>>>(p, n, partial);
      else
        partial_sum_kernel<1, T, false><<<blocks, kSumThreads, 0, stream>>>(p, n, partial);
    }
    ST_CHECK_LAUNCH();
  });
  final_sum_kernel<<<1, kMaxSumBlocks, 0, stream>>>(partial, blocks, result);
  ST_CHECK_LAUNCH();
}

// Enqueues x *= inv_scale, setting *found when an element was inf or nan.
void enqueue_unscale(void* x, DType type, int64_t n, float inv_scale, int* found,
                     cudaStream_t stream) {
  if (n <= 0) return;
  ST_DISPATCH_FLOAT(type, T, {
    T* p = static_cast<T*>(x);
    constexpr int V = kVec<T>;
    if (aligned(p, 16))
      unscale_kernel<V><<<grid_for(n / V + 1), kThreads, 0, stream>>>(p, n, inv_scale, found);
    else
      unscale_kernel<1><<<grid_for(n), kThreads, 0, stream>>>(p, n, inv_scale, found);
    ST_CHECK_LAUNCH();
  });
}

template <typename T>
void copy_to_host_and_wait(T* host, const T* device, int64_t count, cudaStream_t stream) {
  ST_CUDA_CHECK(cudaMemcpyAsync(host, device, sizeof(T) * static_cast<size_t>(count),
                                cudaMemcpyDeviceToHost, stream));
  ST_CUDA_CHECK(cudaStreamSynchronize(stream));
}

}  // namespace

double sum(const void* x, DType type, int64_t n, bool squares, Scratch& scratch,
           cudaStream_t stream) {
  if (n <= 0) return 0.0;
  auto* partial = static_cast<double*>(scratch.get(sizeof(double) * (kMaxSumBlocks + 1)));
  double* result = partial + kMaxSumBlocks;
  enqueue_sum(x, type, n, squares, partial, result, stream);
  double host = 0.0;
  copy_to_host_and_wait(&host, result, 1, stream);
  return host;
}

void sum_squares_multi(const TensorSpan* tensors, int64_t count, double* out, Scratch& scratch,
                       cudaStream_t stream) {
  if (count <= 0) return;
  // One partial buffer serves every tensor: the stream runs each final sum before the next
  // tensor's partial sums overwrite it.
  auto* partial = static_cast<double*>(
      scratch.get(sizeof(double) * static_cast<size_t>(kMaxSumBlocks + count)));
  double* results = partial + kMaxSumBlocks;
  for (int64_t i = 0; i < count; ++i)
    enqueue_sum(tensors[i].data, tensors[i].type, tensors[i].n, true, partial, results + i, stream);
  copy_to_host_and_wait(out, results, count, stream);
}

bool unscale_and_check(void* x, DType type, int64_t n, float inv_scale, Scratch& scratch,
                       cudaStream_t stream) {
  const TensorSpan one{x, type, n};
  return unscale_and_check_multi(&one, 1, inv_scale, scratch, stream);
}

bool unscale_and_check_multi(const TensorSpan* tensors, int64_t count, float inv_scale,
                             Scratch& scratch, cudaStream_t stream) {
  int64_t elements = 0;
  for (int64_t i = 0; i < count; ++i) elements += std::max<int64_t>(tensors[i].n, 0);
  if (elements == 0) return false;
  int* found = static_cast<int*>(scratch.get(sizeof(int)));
  ST_CUDA_CHECK(cudaMemsetAsync(found, 0, sizeof(int), stream));
  for (int64_t i = 0; i < count; ++i)
    enqueue_unscale(tensors[i].data, tensors[i].type, tensors[i].n, inv_scale, found, stream);
  int host = 0;
  copy_to_host_and_wait(&host, found, 1, stream);
  return host != 0;
}

}  // namespace shardtrain::kernels
