// Embedding lookup and its deterministic gradient, plus index validation.
//
// Backward: grad_weight[ids[i]] += grad_out[i] must not race when ids repeat, and must sum in a
// fixed order. The token positions are sorted by id with a stable radix sort (CUB), then one
// block per distinct id walks its run of positions in increasing order and adds the fp32 sum to
// the weight row. No atomics; the cost is one sort of N keys. A very frequent id (say a padding
// token in most positions) is summed by a single block, which is slower but still exact.
#if !defined(SHARDTRAIN_SIMT)  // the CPU emulator (tests/simt) brings its own stand-in
#include <cub/device/device_radix_sort.cuh>
#endif

#include "common.cuh"

namespace shardtrain::kernels {

namespace {

__global__ void first_bad_kernel(const int64_t* ids, int64_t n, int64_t limit, int64_t ignore,
                                 unsigned long long* first) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t id = ids[i];
    if ((id < 0 || id >= limit) && id != ignore)
      atomicMin(first, static_cast<unsigned long long>(i));
  }
}

// Index: the type of the loop's arithmetic, 32-bit when the output allows (index32_fits); the
// weight row's offset is always 64-bit.
template <int N, typename Index, typename TW, typename TO>
__global__ void embedding_forward_kernel(const TW* weight, const int64_t* ids, TO* out, Index n,
                                         Index hidden) {
  const Index per_row = hidden / N;
  const Index total = n * per_row;
  for (Index idx = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<Index>(gridDim.x) * blockDim.x) {
    const Index i = idx / per_row, j = (idx - i * per_row) * N;
    float v[N];
    load_vec<TW, N>(weight + ids[i] * static_cast<int64_t>(hidden) + j, v);
    store_vec<TO, N>(out + i * hidden + j, v);
  }
}

template <int N, typename TW, typename TO>
void launch_embedding_forward(const TW* w, const int64_t* ids, TO* o, int64_t n, int64_t hidden,
                              cudaStream_t stream) {
  const int64_t items = n * hidden / N;
  if (index32_fits(n * hidden))
    embedding_forward_kernel<N, uint32_t><<<grid_for(items), kThreads, 0, stream>>>(
        w, ids, o, static_cast<uint32_t>(n), static_cast<uint32_t>(hidden));
  else
    embedding_forward_kernel<N, int64_t>
        <<<grid_for(items), kThreads, 0, stream>>>(w, ids, o, n, hidden);
  ST_CHECK_LAUNCH();
}

// Keys: the id (ids outside [0, vocab) become `vocab`, sorted last and skipped); values: the
// token position.
__global__ void make_sort_input_kernel(const int64_t* ids, int64_t n, int64_t vocab,
                                       unsigned long long* keys, int64_t* positions) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t id = ids[i];
    keys[i] = static_cast<unsigned long long>(id >= 0 && id < vocab ? id : vocab);
    positions[i] = i;
  }
}

constexpr int kRunThreads = 128;
constexpr int kRunColumns = 4;  // columns per thread per pass

// One block per sorted position; only the first position of each run of equal ids works.
template <typename T>
__global__ void __launch_bounds__(kRunThreads)
    embedding_run_sum_kernel(const T* grad_out, const unsigned long long* keys,
                             const int64_t* positions, int64_t n, int64_t vocab, int64_t hidden,
                             float* grad_weight) {
  const int64_t start = blockIdx.x;
  const unsigned long long id = keys[start];
  if (id >= static_cast<unsigned long long>(vocab)) return;
  if (start > 0 && keys[start - 1] == id) return;
  int64_t end = start + 1;
  while (end < n && keys[end] == id) ++end;
  float* row = grad_weight + static_cast<int64_t>(id) * hidden;
  for (int64_t c0 = 0; c0 < hidden; c0 += kRunThreads * kRunColumns) {
    float acc[kRunColumns] = {};
    for (int64_t p = start; p < end; ++p) {
      const T* g = grad_out + positions[p] * hidden;
#pragma unroll
      for (int k = 0; k < kRunColumns; ++k) {
        const int64_t c = c0 + k * kRunThreads + threadIdx.x;
        if (c < hidden) acc[k] += to_float(g[c]);
      }
    }
#pragma unroll
    for (int k = 0; k < kRunColumns; ++k) {
      const int64_t c = c0 + k * kRunThreads + threadIdx.x;
      if (c < hidden) row[c] += acc[k];
    }
  }
}

int significant_bits(uint64_t v) {
  int bits = 0;
  while (v != 0) {
    ++bits;
    v >>= 1;
  }
  return bits == 0 ? 1 : bits;
}

}  // namespace

int64_t first_bad_index(const int64_t* ids, int64_t n, int64_t limit, int64_t ignore,
                        Scratch& scratch, cudaStream_t stream) {
  if (n <= 0) return -1;
  auto* first = static_cast<unsigned long long*>(scratch.get(sizeof(unsigned long long)));
  ST_CUDA_CHECK(cudaMemsetAsync(first, 0xff, sizeof(unsigned long long), stream));
  first_bad_kernel<<<grid_for(n), kThreads, 0, stream>>>(ids, n, limit, ignore, first);
  ST_CHECK_LAUNCH();
  unsigned long long host = 0;
  ST_CUDA_CHECK(cudaMemcpyAsync(&host, first, sizeof(host), cudaMemcpyDeviceToHost, stream));
  ST_CUDA_CHECK(cudaStreamSynchronize(stream));
  return host == ~0ull ? -1 : static_cast<int64_t>(host);
}

void embedding_forward(const void* weight, DType tw, const int64_t* ids, void* out, DType to,
                       int64_t n, int64_t vocab, int64_t hidden, cudaStream_t stream) {
  if (n <= 0 || hidden <= 0) return;
  ST_DISPATCH_FLOAT(
      tw, TW, ST_DISPATCH_FLOAT(to, TO, {
        const TW* w = static_cast<const TW*>(weight);
        TO* o = static_cast<TO*>(out);
        if (hidden % 4 == 0 && aligned(w, 4 * sizeof(TW)) && aligned(o, 4 * sizeof(TO)))
          launch_embedding_forward<4>(w, ids, o, n, hidden, stream);
        else
          launch_embedding_forward<1>(w, ids, o, n, hidden, stream);
      }));
}

void embedding_backward(const void* grad_out, DType tg, const int64_t* ids, float* grad_weight,
                        int64_t n, int64_t vocab, int64_t hidden, Scratch& scratch,
                        cudaStream_t stream) {
  if (n <= 0 || hidden <= 0) return;
  ST_CHECK(n <= INT32_MAX, "embedding backward over ", n, " tokens: at most 2^31 - 1 supported");
  auto* keys_in = static_cast<unsigned long long*>(scratch.get(sizeof(unsigned long long) * n));
  auto* keys_out = static_cast<unsigned long long*>(scratch.get(sizeof(unsigned long long) * n));
  auto* pos_in = static_cast<int64_t*>(scratch.get(sizeof(int64_t) * n));
  auto* pos_out = static_cast<int64_t*>(scratch.get(sizeof(int64_t) * n));
  make_sort_input_kernel<<<grid_for(n), kThreads, 0, stream>>>(ids, n, vocab, keys_in, pos_in);
  ST_CHECK_LAUNCH();

  // Only the bits that can differ (ids up to vocab, the out-of-range marker) are sorted.
  const int end_bit = significant_bits(static_cast<uint64_t>(vocab));
  const int items = static_cast<int>(n);
  size_t temp_bytes = 0;
  ST_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys_in, keys_out, pos_in,
                                                pos_out, items, 0, end_bit, stream));
  void* temp = scratch.get(temp_bytes);
  ST_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out, pos_in,
                                                pos_out, items, 0, end_bit, stream));

  ST_DISPATCH_FLOAT(tg, T, {
    embedding_run_sum_kernel<T><<<static_cast<unsigned>(n), kRunThreads, 0, stream>>>(
        static_cast<const T*>(grad_out), keys_out, pos_out, n, vocab, hidden, grad_weight);
    ST_CHECK_LAUNCH();
  });
}

}  // namespace shardtrain::kernels
