// Elementwise kernels: fill, cast, add, mul, scale, the last-dimension broadcast multiply and its
// weight gradient. Grid-stride loops over 4-element vectors when every operand is aligned for
// them, scalar otherwise; a scalar tail handles the remainder.
#include <cstring>
#include <type_traits>

#include "common.cuh"

namespace shardtrain::kernels {

namespace {

// ---- fill -----------------------------------------------------------------------------------

__global__ void fill16_kernel(uint4* out, int64_t n, uint4 pattern) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = pattern;
}

template <typename W>
__global__ void fill_kernel(W* out, int64_t n, W value) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = value;
}

template <typename W>
void fill_words(void* out, int64_t n, const char* pattern, cudaStream_t stream) {
  W value;
  std::memcpy(&value, pattern, sizeof(W));
  int64_t done = 0;
  if (aligned(out, 16)) {
    uint4 wide;
    W* lanes = reinterpret_cast<W*>(&wide);
    for (size_t i = 0; i < sizeof(uint4) / sizeof(W); ++i) lanes[i] = value;
    const int64_t n16 = n * static_cast<int64_t>(sizeof(W)) / 16;
    if (n16 > 0) {
      fill16_kernel<<<grid_for(n16), kThreads, 0, stream>>>(static_cast<uint4*>(out), n16, wide);
      ST_CHECK_LAUNCH();
    }
    done = n16 * 16 / static_cast<int64_t>(sizeof(W));
  }
  if (done < n) {
    fill_kernel<W>
        <<<grid_for(n - done), kThreads, 0, stream>>>(static_cast<W*>(out) + done, n - done, value);
    ST_CHECK_LAUNCH();
  }
}

// ---- cast -----------------------------------------------------------------------------------

template <typename T>
constexpr bool is_float_storage =
    std::is_same_v<T, float> || std::is_same_v<T, bf16> || std::is_same_v<T, f16>;

// Element conversion with the semantics of convert_elements on the host: float sources are read
// as fp32, integer sources as themselves, and the value is cast into the destination.
template <typename D, typename S>
__device__ __forceinline__ D convert_element(S s) {
  if constexpr (is_float_storage<S>) {
    const float f = to_float(s);
    if constexpr (is_float_storage<D>)
      return from_float<D>(f);
    else
      return static_cast<D>(f);
  } else {
    if constexpr (is_float_storage<D>)
      return from_float<D>(static_cast<float>(s));
    else
      return static_cast<D>(s);
  }
}

template <typename S, typename D>
__global__ void cast_kernel(const S* src, D* dst, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = convert_element<D>(src[i]);
}

template <typename S, typename D>
__global__ void cast_vec4_kernel(const S* src, D* dst, int64_t n4) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n4;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v[4];
    load_vec<S, 4>(src + 4 * i, v);
    store_vec<D, 4>(dst + 4 * i, v);
  }
}

#define ST_DISPATCH_ANY(dtype, T, ...)          \
  switch (dtype) {                              \
    case DType::I32: {                          \
      using T = int32_t;                        \
      __VA_ARGS__;                              \
    } break;                                    \
    case DType::I64: {                          \
      using T = int64_t;                        \
      __VA_ARGS__;                              \
    } break;                                    \
    case DType::U8: {                           \
      using T = uint8_t;                        \
      __VA_ARGS__;                              \
    } break;                                    \
    default:                                    \
      ST_DISPATCH_FLOAT(dtype, T, __VA_ARGS__); \
  }

template <typename S, typename D>
void launch_cast(const void* src, void* dst, int64_t n, cudaStream_t stream) {
  const S* s = static_cast<const S*>(src);
  D* d = static_cast<D*>(dst);
  int64_t done = 0;
  if constexpr (is_float_storage<S> && is_float_storage<D>) {
    if (aligned(s, 4 * sizeof(S)) && aligned(d, 4 * sizeof(D)) && n >= 4) {
      const int64_t n4 = n / 4;
      cast_vec4_kernel<S, D><<<grid_for(n4), kThreads, 0, stream>>>(s, d, n4);
      ST_CHECK_LAUNCH();
      done = 4 * n4;
    }
  }
  if (done < n) {
    cast_kernel<S, D><<<grid_for(n - done), kThreads, 0, stream>>>(s + done, d + done, n - done);
    ST_CHECK_LAUNCH();
  }
}

// ---- binary and unary maps ------------------------------------------------------------------

// Both products rounded before the sum, as on the CPU: a fused multiply-add would differ from
// the CPU backend in the last bit.
struct AddOp {
  float alpha, beta;
  __device__ float operator()(float a, float b) const {
    return __fadd_rn(__fmul_rn(alpha, a), __fmul_rn(beta, b));
  }
};
struct MulOp {
  __device__ float operator()(float a, float b) const { return a * b; }
};
struct ScaleOp {
  float alpha;
  __device__ float operator()(float a) const { return a * alpha; }
};

// No __restrict__: out may alias a or b. Each element is read before it is written by the same
// thread, which makes the aliasing safe.
template <int N, typename TA, typename TB, typename TO, typename Op>
__global__ void binary_kernel(const TA* a, const TB* b, TO* out, int64_t n, Op op) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nvec = n / N;
  for (int64_t i = first; i < nvec; i += stride) {
    float x[N], y[N];
    load_vec<TA, N>(a + i * N, x);
    load_vec<TB, N>(b + i * N, y);
#pragma unroll
    for (int k = 0; k < N; ++k) x[k] = op(x[k], y[k]);
    store_vec<TO, N>(out + i * N, x);
  }
  for (int64_t i = nvec * N + first; i < n; i += stride)
    out[i] = from_float<TO>(op(to_float(a[i]), to_float(b[i])));
}

template <int N, typename TA, typename TO, typename Op>
__global__ void unary_kernel(const TA* a, TO* out, int64_t n, Op op) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nvec = n / N;
  for (int64_t i = first; i < nvec; i += stride) {
    float x[N];
    load_vec<TA, N>(a + i * N, x);
#pragma unroll
    for (int k = 0; k < N; ++k) x[k] = op(x[k]);
    store_vec<TO, N>(out + i * N, x);
  }
  for (int64_t i = nvec * N + first; i < n; i += stride)
    out[i] = from_float<TO>(op(to_float(a[i])));
}

template <typename Op>
void launch_binary(const void* a, DType ta, const void* b, DType tb, void* out, DType to, int64_t n,
                   Op op, cudaStream_t stream) {
  if (n <= 0) return;
  ST_DISPATCH_FLOAT(
      ta, TA, ST_DISPATCH_FLOAT(tb, TB, ST_DISPATCH_FLOAT(to, TO, {
                                  const TA* pa = static_cast<const TA*>(a);
                                  const TB* pb = static_cast<const TB*>(b);
                                  TO* po = static_cast<TO*>(out);
                                  const bool vec = aligned(pa, 4 * sizeof(TA)) &&
                                                   aligned(pb, 4 * sizeof(TB)) &&
                                                   aligned(po, 4 * sizeof(TO));
                                  if (vec)
                                    binary_kernel<4><<<grid_for(n / 4 + 1), kThreads, 0, stream>>>(
                                        pa, pb, po, n, op);
                                  else
                                    binary_kernel<1>
                                        <<<grid_for(n), kThreads, 0, stream>>>(pa, pb, po, n, op);
                                  ST_CHECK_LAUNCH();
                                })));
}

// ---- last-dimension broadcast ---------------------------------------------------------------

template <int N, typename TX, typename TW, typename TO>
__global__ void mul_lastdim_kernel(const TX* x, const TW* w, TO* out, int64_t n, int64_t width) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nvec = n / N;
  // With N > 1 the width is a multiple of N, so a vector never straddles two rows.
  for (int64_t i = first; i < nvec; i += stride) {
    float v[N];
    load_vec<TX, N>(x + i * N, v);
    const int64_t j = (i * N) % width;
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] *= to_float(w[j + k]);
    store_vec<TO, N>(out + i * N, v);
  }
  for (int64_t i = nvec * N + first; i < n; i += stride)
    out[i] = from_float<TO>(to_float(x[i]) * to_float(w[i % width]));
}

template <typename TA, typename TB>
struct ProductTerm {
  const TA* a;
  const TB* b;
  int64_t cols;
  __device__ float operator()(int64_t r, int64_t c) const {
    return to_float(a[r * cols + c]) * to_float(b[r * cols + c]);
  }
};

}  // namespace

void fill(void* out, DType type, int64_t n, float value, cudaStream_t stream) {
  if (n <= 0) return;
  // The value's bit pattern in `type`, converted as convert_elements does on the host.
  char pattern[8] = {};
  auto put = [&](auto v) { std::memcpy(pattern, &v, sizeof(v)); };
  switch (type) {
    case DType::F32:
      put(value);
      break;
    case DType::BF16:
      put(float_to_bf16(value));
      break;
    case DType::F16:
      put(float_to_f16(value));
      break;
    case DType::I32:
      put(static_cast<int32_t>(value));
      break;
    case DType::I64:
      put(static_cast<int64_t>(value));
      break;
    case DType::U8:
      put(static_cast<uint8_t>(value));
      break;
  }
  switch (dtype_size(type)) {
    case 1:
      fill_words<uint8_t>(out, n, pattern, stream);
      break;
    case 2:
      fill_words<uint16_t>(out, n, pattern, stream);
      break;
    case 4:
      fill_words<uint32_t>(out, n, pattern, stream);
      break;
    default:
      fill_words<uint64_t>(out, n, pattern, stream);
      break;
  }
}

void cast(const void* src, DType src_type, void* dst, DType dst_type, int64_t n,
          cudaStream_t stream) {
  if (n <= 0) return;
  if (src_type == dst_type) {
    ST_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * dtype_size(src_type),
                                  cudaMemcpyDeviceToDevice, stream));
    return;
  }
  ST_DISPATCH_ANY(src_type, S,
                  ST_DISPATCH_ANY(dst_type, D, launch_cast<S, D>(src, dst, n, stream)));
}

void add(const void* a, DType ta, const void* b, DType tb, void* out, DType to, int64_t n,
         float alpha, float beta, cudaStream_t stream) {
  launch_binary(a, ta, b, tb, out, to, n, AddOp{alpha, beta}, stream);
}

void mul(const void* a, DType ta, const void* b, DType tb, void* out, DType to, int64_t n,
         cudaStream_t stream) {
  launch_binary(a, ta, b, tb, out, to, n, MulOp{}, stream);
}

void scale(const void* a, DType ta, void* out, DType to, int64_t n, float alpha,
           cudaStream_t stream) {
  if (n <= 0) return;
  ST_DISPATCH_FLOAT(
      ta, TA, ST_DISPATCH_FLOAT(to, TO, {
        const TA* pa = static_cast<const TA*>(a);
        TO* po = static_cast<TO*>(out);
        if (aligned(pa, 4 * sizeof(TA)) && aligned(po, 4 * sizeof(TO)))
          unary_kernel<4><<<grid_for(n / 4 + 1), kThreads, 0, stream>>>(pa, po, n, ScaleOp{alpha});
        else
          unary_kernel<1><<<grid_for(n), kThreads, 0, stream>>>(pa, po, n, ScaleOp{alpha});
        ST_CHECK_LAUNCH();
      }));
}

void mul_lastdim(const void* x, DType tx, const void* w, DType tw, void* out, DType to, int64_t n,
                 int64_t width, cudaStream_t stream) {
  if (n <= 0 || width <= 0) return;
  ST_DISPATCH_FLOAT(
      tx, TX,
      ST_DISPATCH_FLOAT(
          tw, TW, ST_DISPATCH_FLOAT(to, TO, {
            const TX* px = static_cast<const TX*>(x);
            const TW* pw = static_cast<const TW*>(w);
            TO* po = static_cast<TO*>(out);
            if (width % 4 == 0 && aligned(px, 4 * sizeof(TX)) && aligned(po, 4 * sizeof(TO)))
              mul_lastdim_kernel<4>
                  <<<grid_for(n / 4 + 1), kThreads, 0, stream>>>(px, pw, po, n, width);
            else
              mul_lastdim_kernel<1><<<grid_for(n), kThreads, 0, stream>>>(px, pw, po, n, width);
            ST_CHECK_LAUNCH();
          })));
}

void mul_lastdim_backward_weight(const void* dy, DType tdy, const void* x, DType tx, float* grad_w,
                                 int64_t rows, int64_t width, Scratch& scratch,
                                 cudaStream_t stream) {
  ST_DISPATCH_FLOAT(tdy, TA, ST_DISPATCH_FLOAT(tx, TB, {
                      column_sum(ProductTerm<TA, TB>{static_cast<const TA*>(dy),
                                                     static_cast<const TB*>(x), width},
                                 rows, width, grad_w, scratch, stream);
                    }));
}

}  // namespace shardtrain::kernels
