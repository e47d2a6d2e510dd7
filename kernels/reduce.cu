// Whole-tensor sums in fp64 and the fused unscale + inf/nan check.
//
// Sums are deterministic: the grid size depends only on the element count, each thread walks a
// fixed grid-stride sequence, blocks reduce with a fixed tree, and one final block adds the
// block partials in a fixed tree as well.
#include <type_traits>

#include "common.cuh"

namespace shardtrain::kernels {

namespace {

constexpr int kSumThreads = 256;
constexpr int64_t kMaxSumBlocks = 1024;

// The grid of a sum over n elements: it depends on n alone, which keeps the result's bits
// independent of anything but the values and their alignment.
int64_t sum_blocks(int64_t n) {
  return std::min<int64_t>(kMaxSumBlocks, (n + kSumThreads * 8 - 1) / (kSumThreads * 8));
}

// This thread's share of the sum as block `block` of a grid of `grid` blocks: a fixed
// grid-stride walk, N elements per step (N = 1: scalar loads), then the tail.
template <int N, typename T, bool kSquares>
__device__ __forceinline__ double thread_sum(const T* x, int64_t n, int64_t block, int64_t grid) {
  const int64_t stride = grid * blockDim.x;
  const int64_t first = block * blockDim.x + threadIdx.x;
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
  return acc;
}

template <int N, typename T, bool kSquares>
__global__ void __launch_bounds__(kSumThreads)
    partial_sum_kernel(const T* x, int64_t n, double* partial) {
  __shared__ double red[33];
  const double acc = block_sum(thread_sum<N, T, kSquares>(x, n, blockIdx.x, gridDim.x), red);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// The block partials of `blocks` sums, in one block of kMaxSumBlocks threads.
__device__ __forceinline__ double final_sum(const double* partial, int64_t blocks) {
  __shared__ double red[33];
  return block_sum(threadIdx.x < blocks ? partial[threadIdx.x] : 0.0, red);
}

__global__ void __launch_bounds__(kMaxSumBlocks)
    final_sum_kernel(const double* partial, int64_t blocks, double* result) {
  const double acc = final_sum(partial, blocks);
  if (threadIdx.x == 0) *result = acc;
}

// A list of up to kListMax tensors of one dtype and load width for one launch (common.cuh). A
// block of tensor t works as block b - first_block[t] of a grid of first_block[t + 1] -
// first_block[t] blocks, so it does exactly what that block of a launch on the tensor alone
// would do.
template <typename P>  // const T* or T*
struct TensorList {
  P x[kListMax];
  int64_t n[kListMax];
  int64_t first_block[kListMax + 1];
  int64_t out[kListMax];  // the tensor's index in the caller's list
  int count;
};

// This block's tensor in `list`, and its block index and grid within that tensor.
struct ListBlock {
  int tensor;
  int64_t block, grid;
};
template <typename P>
__device__ __forceinline__ ListBlock list_block(const TensorList<P>& list) {
  const int t = list_tensor(list.first_block);
  return {t, blockIdx.x - list.first_block[t], list.first_block[t + 1] - list.first_block[t]};
}

// Calls launch(list) for the tensors of `spans` whose dtype is T and whose 16-byte alignment is
// `vectorized`, kListMax at a time, tensor i getting blocks_of(n) blocks.
template <typename P, typename BlocksOf, typename Launch>
void for_each_list(const TensorSpan* spans, int64_t count, bool vectorized, BlocksOf blocks_of,
                   Launch launch) {
  using T = std::remove_const_t<std::remove_pointer_t<P>>;
  TensorList<P> list{};
  auto flush = [&] {
    if (list.count > 0) launch(list);
    list = TensorList<P>{};
  };
  for (int64_t i = 0; i < count; ++i) {
    const TensorSpan& s = spans[i];
    const auto x = static_cast<P>(s.data);
    if (s.n <= 0 || s.type != dtype_of<T>() || aligned(x, 16) != vectorized) continue;
    const int k = list.count++;
    list.x[k] = x;
    list.n[k] = s.n;
    list.out[k] = i;
    list.first_block[k + 1] = list.first_block[k] + blocks_of(s.n);
    if (list.count == kListMax) flush();
  }
  flush();
}

// Sums of squares of a list in two launches: each tensor gets the blocks its single-tensor sum
// would get (sum_blocks), and every block, and then the final block of each tensor, computes
// exactly what it computes there, so a tensor's result is the single-tensor result bit for bit.
template <typename T>
using SumSquaresList = TensorList<const T*>;

template <int N, typename T>
__global__ void __launch_bounds__(kSumThreads)
    partial_sum_squares_list_kernel(const SumSquaresList<T> list, double* partial) {
  __shared__ double red[33];
  const ListBlock lb = list_block(list);
  const double acc = block_sum(
      thread_sum<N, T, true>(list.x[lb.tensor], list.n[lb.tensor], lb.block, lb.grid), red);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// One block per tensor of the list: its partials (at partial + first_block[t]) into results.
template <typename T>
__global__ void __launch_bounds__(kMaxSumBlocks)
    final_sum_squares_list_kernel(const SumSquaresList<T> list, const double* partial,
                                  double* results) {
  const int t = blockIdx.x;
  const int64_t first = list.first_block[t];
  const double acc = final_sum(partial + first, list.first_block[t + 1] - first);
  if (threadIdx.x == 0) results[list.out[t]] = acc;
}

// Enqueues the sums of squares of the tensors of `spans` whose dtype is T and whose 16-byte
// alignment is `vectorized`; `partial` holds kListMax * kMaxSumBlocks doubles.
template <typename T>
void enqueue_sum_squares_lists(const TensorSpan* spans, int64_t count, bool vectorized,
                               double* partial, double* results, cudaStream_t stream) {
  for_each_list<const T*>(spans, count, vectorized, sum_blocks, [&](const SumSquaresList<T>& list) {
    const auto blocks = static_cast<unsigned>(list.first_block[list.count]);
    if (vectorized)
      partial_sum_squares_list_kernel<kVec<T>, T>
          <<<blocks, kSumThreads, 0, stream>>>(list, partial);
    else
      partial_sum_squares_list_kernel<1, T><<<blocks, kSumThreads, 0, stream>>>(list, partial);
    ST_CHECK_LAUNCH();
    final_sum_squares_list_kernel<T>
        <<<static_cast<unsigned>(list.count), kMaxSumBlocks, 0, stream>>>(list, partial, results);
    ST_CHECK_LAUNCH();
  });
}

// x *= inv_scale over this thread's share as block `block` of a grid of `grid` blocks (N
// elements a step, then the tail); true when an element was inf or nan.
template <int N, typename T>
__device__ __forceinline__ bool thread_unscale(T* x, int64_t n, float inv_scale, int64_t block,
                                               int64_t grid) {
  const int64_t stride = grid * blockDim.x;
  const int64_t first = block * blockDim.x + threadIdx.x;
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
  return bad;
}

__device__ __forceinline__ void report_bad(bool bad, int* found) {
  if (__any_sync(0xffffffffu, bad) && (threadIdx.x & 31) == 0) *found = 1;
}

template <int N, typename T>
__global__ void unscale_list_kernel(const TensorList<T*> list, float inv_scale, int* found) {
  const ListBlock lb = list_block(list);
  report_bad(thread_unscale<N>(list.x[lb.tensor], list.n[lb.tensor], inv_scale, lb.block, lb.grid),
             found);
}

// Blocks that unscale n elements: one element (or vector) a thread, up to grid_for's cap.
template <int N>
int64_t unscale_blocks(int64_t n) {
  return grid_for(n / N + 1);
}

// Enqueues the unscale of the tensors of `spans` whose dtype is T and whose 16-byte alignment is
// `vectorized`, one launch per kListMax tensors.
template <typename T>
void enqueue_unscale_lists(const TensorSpan* spans, int64_t count, bool vectorized, float inv_scale,
                           int* found, cudaStream_t stream) {
  constexpr int V = kVec<T>;
  auto launch = [&](const TensorList<T*>& list) {
    const auto blocks = static_cast<unsigned>(list.first_block[list.count]);
    if (vectorized)
      unscale_list_kernel<V, T><<<blocks, kThreads, 0, stream>>>(list, inv_scale, found);
    else
      unscale_list_kernel<1, T><<<blocks, kThreads, 0, stream>>>(list, inv_scale, found);
    ST_CHECK_LAUNCH();
  };
  if (vectorized)
    for_each_list<T*>(spans, count, true, unscale_blocks<V>, launch);
  else
    for_each_list<T*>(spans, count, false, unscale_blocks<1>, launch);
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
  const int64_t blocks = sum_blocks(n);
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

// The lists take float tensors only; any other dtype would be left out silently.
void require_float_spans(const TensorSpan* spans, int64_t count, const char* what) {
  for (int64_t i = 0; i < count; ++i) {
    const DType t = spans[i].type;
    if (spans[i].n > 0 && t != DType::F32 && t != DType::BF16 && t != DType::F16)
      throw ShapeError(detail::concat(what, ": tensor ", i, " of the list is ", dtype_name(t),
                                      "; CUDA kernel needs a float tensor (f32, bf16, f16)"));
  }
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
  require_float_spans(tensors, count, "sum of squares");
  // A model's gradients in a few launches (one pair per dtype and load width, per kListMax
  // tensors) rather than two per tensor: 111 tensors of llama-125m took 0.83 ms as 222 launches
  // on an H100. Empty tensors keep the zero of the memset. The stream runs each list's final
  // sums before the next list's partial sums overwrite the shared partial buffer.
  auto* partial = static_cast<double*>(
      scratch.get(sizeof(double) * static_cast<size_t>(kListMax * kMaxSumBlocks + count)));
  double* results = partial + kListMax * kMaxSumBlocks;
  ST_CUDA_CHECK(cudaMemsetAsync(results, 0, sizeof(double) * static_cast<size_t>(count), stream));
  for (bool vectorized : {true, false}) {
    enqueue_sum_squares_lists<float>(tensors, count, vectorized, partial, results, stream);
    enqueue_sum_squares_lists<bf16>(tensors, count, vectorized, partial, results, stream);
    enqueue_sum_squares_lists<f16>(tensors, count, vectorized, partial, results, stream);
  }
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
  require_float_spans(tensors, count, "unscale");
  int* found = static_cast<int*>(scratch.get(sizeof(int)));
  ST_CUDA_CHECK(cudaMemsetAsync(found, 0, sizeof(int), stream));
  // A model's gradients in a few launches (one per dtype, load width and kListMax tensors).
  for (bool vectorized : {true, false}) {
    enqueue_unscale_lists<float>(tensors, count, vectorized, inv_scale, found, stream);
    enqueue_unscale_lists<bf16>(tensors, count, vectorized, inv_scale, found, stream);
    enqueue_unscale_lists<f16>(tensors, count, vectorized, inv_scale, found, stream);
  }
  int host = 0;
  copy_to_host_and_wait(&host, found, 1, stream);
  return host != 0;
}

}  // namespace shardtrain::kernels
