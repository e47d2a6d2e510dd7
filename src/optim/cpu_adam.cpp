// The CPU AdamW kernels. This file is compiled with -ffp-contract=off (src/CMakeLists.txt): a fused
// multiply-add rounds once where the reference rounds twice, so contracting `a * b + c` anywhere
// here (the scalar loop or the intrinsics, which GCC treats as ordinary vector arithmetic) would
// break bitwise equality with Backend::adamw.
#include "shardtrain/optim/cpu_adam.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>

#include "shardtrain/core/error.h"

// The scalar kernel is the no-SIMD baseline the benchmark compares against: keep the compiler from
// vectorizing it (vectorizing would not change its results, only its speed).
#if defined(__clang__)
#define ST_NO_AUTO_VECTORIZE
#define ST_SCALAR_LOOP _Pragma("clang loop vectorize(disable) interleave(disable)")
#elif defined(__GNUC__)
#define ST_NO_AUTO_VECTORIZE __attribute__((optimize("no-tree-vectorize")))
#define ST_SCALAR_LOOP
#else
#define ST_NO_AUTO_VECTORIZE
#define ST_SCALAR_LOOP
#endif

namespace shardtrain::optim {

namespace {

// Elements per OpenMP work item; also the size of the per-thread fp32 conversion buffers
// (16 KiB each), so a block's operands stay in L1/L2 between conversion and update.
constexpr int64_t kBlock = 4096;
// Below this many elements one thread does the whole step (a parallel region costs more).
constexpr int64_t kMinParallel = 1 << 15;

// The per-step scalars, formed exactly as the CPU backend forms them.
struct Constants {
  float decay, beta1, beta2, one_minus_beta1, one_minus_beta2, step_size, bc2_sqrt, eps;
};

Constants make_constants(const Backend::AdamWArgs& args) {
  const double step = static_cast<double>(args.step);
  Constants c;
  c.decay = static_cast<float>(1.0 - static_cast<double>(args.lr) * args.weight_decay);
  c.beta1 = args.beta1;
  c.beta2 = args.beta2;
  c.one_minus_beta1 = static_cast<float>(1.0 - static_cast<double>(args.beta1));
  c.one_minus_beta2 = static_cast<float>(1.0 - static_cast<double>(args.beta2));
  const double bc1 = 1.0 - std::pow(static_cast<double>(args.beta1), step);
  const double bc2 = 1.0 - std::pow(static_cast<double>(args.beta2), step);
  c.step_size = static_cast<float>(static_cast<double>(args.lr) / bc1);
  c.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  c.eps = args.eps;
  return c;
}

using UpdateFn = void (*)(const Constants&, float*, const float*, float*, float*, int64_t);

// Per element, in this order (the CPU backend's):
//   m = beta1*m + (1-beta1)*g;  v = beta2*v + ((1-beta2)*g)*g;
//   p = p*decay - step_size * (m / (sqrt(v)/bc2_sqrt + eps))
ST_NO_AUTO_VECTORIZE void update_scalar(const Constants& c, float* p, const float* g, float* m,
                                        float* v, int64_t n) {
  ST_SCALAR_LOOP
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float mi = c.beta1 * m[i] + c.one_minus_beta1 * gi;
    const float vi = c.beta2 * v[i] + c.one_minus_beta2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const float denom = std::sqrt(vi) / c.bc2_sqrt + c.eps;
    p[i] = p[i] * c.decay - c.step_size * (mi / denom);
  }
}

__attribute__((target("avx2"))) void update_avx2(const Constants& c, float* p, const float* g,
                                                 float* m, float* v, int64_t n) {
  const __m256 beta1 = _mm256_set1_ps(c.beta1), beta2 = _mm256_set1_ps(c.beta2);
  const __m256 omb1 = _mm256_set1_ps(c.one_minus_beta1);
  const __m256 omb2 = _mm256_set1_ps(c.one_minus_beta2);
  const __m256 decay = _mm256_set1_ps(c.decay), step_size = _mm256_set1_ps(c.step_size);
  const __m256 bc2_sqrt = _mm256_set1_ps(c.bc2_sqrt), eps = _mm256_set1_ps(c.eps);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gi = _mm256_loadu_ps(g + i);
    const __m256 mi =
        _mm256_add_ps(_mm256_mul_ps(beta1, _mm256_loadu_ps(m + i)), _mm256_mul_ps(omb1, gi));
    const __m256 vi = _mm256_add_ps(_mm256_mul_ps(beta2, _mm256_loadu_ps(v + i)),
                                    _mm256_mul_ps(_mm256_mul_ps(omb2, gi), gi));
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), bc2_sqrt), eps);
    const __m256 pi = _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(p + i), decay),
                                    _mm256_mul_ps(step_size, _mm256_div_ps(mi, denom)));
    _mm256_storeu_ps(p + i, pi);
  }
  update_scalar(c, p + i, g + i, m + i, v + i, n - i);  // the last n % 8
}

__attribute__((target("avx512f"))) void update_avx512(const Constants& c, float* p, const float* g,
                                                      float* m, float* v, int64_t n) {
  const __m512 beta1 = _mm512_set1_ps(c.beta1), beta2 = _mm512_set1_ps(c.beta2);
  const __m512 omb1 = _mm512_set1_ps(c.one_minus_beta1);
  const __m512 omb2 = _mm512_set1_ps(c.one_minus_beta2);
  const __m512 decay = _mm512_set1_ps(c.decay), step_size = _mm512_set1_ps(c.step_size);
  const __m512 bc2_sqrt = _mm512_set1_ps(c.bc2_sqrt), eps = _mm512_set1_ps(c.eps);
  for (int64_t i = 0; i < n; i += 16) {
    // The tail is done with masked loads and stores: masked-off lanes compute on zeros and are
    // never stored (floating-point exceptions are masked, as everywhere here). The masked sqrt
    // also keeps GCC 12 from warning about the unmasked one's undefined pass-through operand.
    const __mmask16 k =
        n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m512 gi = _mm512_maskz_loadu_ps(k, g + i);
    const __m512 mi = _mm512_add_ps(_mm512_mul_ps(beta1, _mm512_maskz_loadu_ps(k, m + i)),
                                    _mm512_mul_ps(omb1, gi));
    const __m512 vi = _mm512_add_ps(_mm512_mul_ps(beta2, _mm512_maskz_loadu_ps(k, v + i)),
                                    _mm512_mul_ps(_mm512_mul_ps(omb2, gi), gi));
    _mm512_mask_storeu_ps(m + i, k, mi);
    _mm512_mask_storeu_ps(v + i, k, vi);
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_maskz_sqrt_ps(k, vi), bc2_sqrt), eps);
    const __m512 pi = _mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, p + i), decay),
                                    _mm512_mul_ps(step_size, _mm512_div_ps(mi, denom)));
    _mm512_mask_storeu_ps(p + i, k, pi);
  }
}

UpdateFn resolve(CpuAdamKernel kernel) {
  if (kernel == CpuAdamKernel::Auto) kernel = cpu_adam_best_kernel();
  ST_CHECK(cpu_adam_kernel_supported(kernel), "the CPU AdamW kernel '",
           cpu_adam_kernel_name(kernel),
           "' needs an instruction set this CPU does not have; use 'auto' or 'scalar'");
  switch (kernel) {
    case CpuAdamKernel::Avx512:
      return update_avx512;
    case CpuAdamKernel::Avx2:
      return update_avx2;
    default:
      return update_scalar;
  }
}

void check_grad_dtype(DType t) {
  ST_CHECK(t == DType::F32 || t == DType::BF16 || t == DType::F16,
           "CPU AdamW takes f32, bf16 or f16 gradients, not ", dtype_name(t));
}

// Runs fn(lo, hi) over [0, n) in blocks of kBlock elements, spread over the threads in contiguous
// runs of blocks (good for the hardware prefetchers).
template <typename Fn>
void for_blocks(int64_t n, int threads, Fn&& fn) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  const int team = threads > 0 ? threads : omp_get_max_threads();
  if (team <= 1 || n < kMinParallel) {
    for (int64_t b = 0; b < blocks; ++b) fn(b * kBlock, std::min(n, (b + 1) * kBlock));
    return;
  }
#pragma omp parallel for schedule(static) num_threads(team)
  for (int64_t b = 0; b < blocks; ++b) fn(b * kBlock, std::min(n, (b + 1) * kBlock));
}

// A block of the gradient as fp32 times `scale`: the memory itself for F32 with scale 1, else
// converted (and scaled) into `buffer`. Scaling here keeps the update kernels as they are; the
// extra pass is over a block already in L1.
const float* grad_block(const void* grad, DType dtype, int64_t lo, int64_t count, float scale,
                        float* buffer) {
  if (dtype == DType::F32 && scale == 1.0f) return static_cast<const float*>(grad) + lo;
  if (dtype == DType::F32) {
    const float* g = static_cast<const float*>(grad) + lo;
#pragma omp simd
    for (int64_t i = 0; i < count; ++i) buffer[i] = g[i] * scale;
    return buffer;
  }
  convert_elements(static_cast<const uint16_t*>(grad) + lo, dtype, buffer, DType::F32, count);
  if (scale != 1.0f) {
#pragma omp simd
    for (int64_t i = 0; i < count; ++i) buffer[i] *= scale;
  }
  return buffer;
}

}  // namespace

std::string_view cpu_adam_kernel_name(CpuAdamKernel kernel) {
  switch (kernel) {
    case CpuAdamKernel::Auto:
      return "auto";
    case CpuAdamKernel::Scalar:
      return "scalar";
    case CpuAdamKernel::Avx2:
      return "avx2";
    case CpuAdamKernel::Avx512:
      return "avx512";
  }
  return "?";
}

bool cpu_adam_kernel_supported(CpuAdamKernel kernel) {
  switch (kernel) {
    case CpuAdamKernel::Avx512:
      return __builtin_cpu_supports("avx512f");
    case CpuAdamKernel::Avx2:
      return __builtin_cpu_supports("avx2");
    default:
      return true;
  }
}

CpuAdamKernel cpu_adam_best_kernel() {
  if (cpu_adam_kernel_supported(CpuAdamKernel::Avx512)) return CpuAdamKernel::Avx512;
  if (cpu_adam_kernel_supported(CpuAdamKernel::Avx2)) return CpuAdamKernel::Avx2;
  return CpuAdamKernel::Scalar;
}

void cpu_adamw(float* param, const void* grad, DType grad_dtype, float* exp_avg, float* exp_avg_sq,
               int64_t n, const Backend::AdamWArgs& args, const CpuAdamOptions& options) {
  check_grad_dtype(grad_dtype);
  const UpdateFn update = resolve(options.kernel);
  const Constants c = make_constants(args);
  for_blocks(n, options.threads, [&](int64_t lo, int64_t hi) {
    float g[kBlock];
    const float* gp = grad_block(grad, grad_dtype, lo, hi - lo, args.grad_scale, g);
    update(c, param + lo, gp, exp_avg + lo, exp_avg_sq + lo, hi - lo);
  });
}

void cpu_adamw_bf16_moments(float* param, const void* grad, DType grad_dtype, uint16_t* exp_avg,
                            uint16_t* exp_avg_sq, int64_t n, const Backend::AdamWArgs& args,
                            const CpuAdamOptions& options) {
  check_grad_dtype(grad_dtype);
  const UpdateFn update = resolve(options.kernel);
  const Constants c = make_constants(args);
  for_blocks(n, options.threads, [&](int64_t lo, int64_t hi) {
    float g[kBlock], m[kBlock], v[kBlock];
    const int64_t count = hi - lo;
    const float* gp = grad_block(grad, grad_dtype, lo, count, args.grad_scale, g);
    uint16_t* mq = exp_avg + lo;
    uint16_t* vq = exp_avg_sq + lo;
#pragma omp simd
    for (int64_t i = 0; i < count; ++i) {
      m[i] = bf16_to_float(mq[i]);
      v[i] = bf16_to_float(vq[i]);
    }
    update(c, param + lo, gp, m, v, count);
#pragma omp simd
    for (int64_t i = 0; i < count; ++i) {
      mq[i] = float_to_bf16(m[i]);
      vq[i] = float_to_bf16(v[i]);
    }
  });
}

}  // namespace shardtrain::optim
