// Cross-entropy over vocabulary rows. One block per row walks the vocabulary in vector-sized
// chunks keeping a running (max, sum of exp) per thread (online log-sum-exp, one pass, the max
// updated once a chunk), and the per-thread pairs are combined with fixed-tree block reductions.
// The backward recomputes the log-sum-exp the same way and writes softmax - onehot in a second
// pass.
#include "common.cuh"

namespace shardtrain::kernels {

namespace {

constexpr int kRowThreads = 512;
constexpr int64_t kIgnoreIndex = -100;

// A thread's running (max, sum of exp(x - max)), fed a vector of logits at a time: the max moves
// (one exp to rescale the sum) at most once a vector, and every logit then costs one exp with no
// branch, where a max checked per logit costs a divergent branch and, in a warp whose lanes go
// both ways, two exps. Non-finite logits come out as on the CPU, which takes the row's max
// first, ignoring nans, then sums exp(x - max): -inf adds nothing (the select keeps
// exp(-inf - -inf) out), a nan makes the sum nan, and a +inf makes it nan (exp(inf - inf)).
struct RunningLse {
  float max = -INFINITY;
  float sum = 0.0f;
  template <int N>
  __device__ void add(const float (&v)[N]) {
    float vector_max = v[0];
#pragma unroll
    for (int k = 1; k < N; ++k) vector_max = fmaxf(vector_max, v[k]);  // drops nans
    if (vector_max > max) {
      sum *= expf(max - vector_max);  // 0 * exp(-inf) = 0 before the first finite logit
      max = vector_max;
    }
#pragma unroll
    for (int k = 0; k < N; ++k) sum += v[k] == -INFINITY ? 0.0f : expf(v[k] - max);
  }
};

// The row's log-sum-exp pieces: every thread gets the block max and the block sum of exp.
template <int N, typename T>
__device__ void row_lse(const T* row, int64_t vocab, float* red, float& mx, float& total) {
  RunningLse run;
  const int64_t nvec = vocab / N;
  for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
    float v[N];
    load_vec<T, N>(row + i * N, v);
    run.add(v);
  }
  for (int64_t j = nvec * N + threadIdx.x; j < vocab; j += blockDim.x) {
    const float v[1] = {to_float(row[j])};
    run.add(v);
  }
  mx = block_max(run.max, red);
  // A thread that saw only -inf contributes 0 (and must not form exp(-inf - -inf)); one that saw
  // only nans keeps max = -inf but sum = nan, which has to reach the total as on the CPU.
  const float scaled = run.sum == 0.0f ? 0.0f : run.sum * expf(run.max - mx);
  total = block_sum(scaled, red);
}

template <int N, typename T>
__global__ void __launch_bounds__(kRowThreads)
    cross_entropy_forward_kernel(const T* logits, const int64_t* targets, float* losses,
                                 int64_t vocab) {
  __shared__ float red[33];
  const int64_t i = blockIdx.x;
  const int64_t t = targets[i];
  if (t == kIgnoreIndex) {
    if (threadIdx.x == 0) losses[i] = 0.0f;
    return;
  }
  const T* row = logits + i * vocab;
  float mx, total;
  row_lse<N>(row, vocab, red, mx, total);
  if (threadIdx.x == 0) losses[i] = mx + logf(total) - to_float(row[t]);
}

template <int N, typename T>
__global__ void __launch_bounds__(kRowThreads)
    cross_entropy_backward_kernel(const T* logits, const int64_t* targets, float grad_scale,
                                  T* dlogits, int64_t vocab) {
  __shared__ float red[33];
  const int64_t i = blockIdx.x;
  const int64_t t = targets[i];
  const T* row = logits + i * vocab;
  T* out = dlogits + i * vocab;
  const int64_t nvec = vocab / N;
  if (t == kIgnoreIndex) {
    const float zero[N] = {};
    for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) store_vec<T, N>(out + v * N, zero);
    for (int64_t j = nvec * N + threadIdx.x; j < vocab; j += blockDim.x)
      out[j] = from_float<T>(0.0f);
    return;
  }
  float mx, total;
  row_lse<N>(row, vocab, red, mx, total);
  const float inv = 1.0f / total;
  // Threads rewrite exactly the elements they read (after the block reductions), so dlogits
  // may alias logits.
  for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
    float x[N];
    load_vec<T, N>(row + v * N, x);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float p = expf(x[k] - mx) * inv;
      x[k] = grad_scale * (v * N + k == t ? p - 1.0f : p);
    }
    store_vec<T, N>(out + v * N, x);
  }
  for (int64_t j = nvec * N + threadIdx.x; j < vocab; j += blockDim.x) {
    const float p = expf(to_float(row[j]) - mx) * inv;
    out[j] = from_float<T>(grad_scale * (j == t ? p - 1.0f : p));
  }
}

template <typename T>
bool rows_vectorizable(int64_t vocab, const void* a, const void* b) {
  return (vocab * static_cast<int64_t>(sizeof(T))) % 16 == 0 && aligned(a, 16) && aligned(b, 16);
}

}  // namespace

void cross_entropy_forward(const void* logits, DType type, const int64_t* targets, float* losses,
                           int64_t rows, int64_t vocab, cudaStream_t stream) {
  if (rows <= 0) return;
  ST_DISPATCH_FLOAT(type, T, {
    const T* l = static_cast<const T*>(logits);
    if (rows_vectorizable<T>(vocab, l, l))
      cross_entropy_forward_kernel<kVec<T>>
          <<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(l, targets, losses, vocab);
    else
      cross_entropy_forward_kernel<1>
          <<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(l, targets, losses, vocab);
    ST_CHECK_LAUNCH();
  });
}

void cross_entropy_backward(const void* logits, DType type, const int64_t* targets,
                            float grad_scale, void* dlogits, int64_t rows, int64_t vocab,
                            cudaStream_t stream) {
  if (rows <= 0) return;
  ST_DISPATCH_FLOAT(type, T, {
    const T* l = static_cast<const T*>(logits);
    T* d = static_cast<T*>(dlogits);
    if (rows_vectorizable<T>(vocab, l, d))
      cross_entropy_backward_kernel<kVec<T>>
          <<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(l, targets, grad_scale, d,
                                                                    vocab);
    else
      cross_entropy_backward_kernel<1><<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(
          l, targets, grad_scale, d, vocab);
    ST_CHECK_LAUNCH();
  });
}

}  // namespace shardtrain::kernels
