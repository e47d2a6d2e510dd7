// AdamW on CPU memory, fast: OpenMP over blocks of elements, with scalar, AVX2 and AVX-512 inner
// loops chosen at run time. This is the update the offloaded optimizer runs on its host-resident
// master weights and moments.
//
// Every kernel, at every thread count, gives results bitwise identical to the CPU backend's
// Backend::adamw: the scalars are formed the same way (double, rounded to float once) and each
// element goes through the same fp32 operations in the same order (separate multiplies and adds,
// never fused; IEEE square root and true division). The bf16-moment variant is a separate path
// whose results differ from the fp32-moment one (the moments are rounded to bf16 after each step).
#pragma once
#include <cstdint>
#include <string_view>

#include "shardtrain/backend/backend.h"

namespace shardtrain::optim {

enum class CpuAdamKernel { Auto, Scalar, Avx2, Avx512 };

// "auto", "scalar", "avx2", "avx512".
std::string_view cpu_adam_kernel_name(CpuAdamKernel kernel);
// Whether this CPU (and OS) can run `kernel`; Auto and Scalar always can.
bool cpu_adam_kernel_supported(CpuAdamKernel kernel);
// The widest supported kernel (what Auto runs).
CpuAdamKernel cpu_adam_best_kernel();

struct CpuAdamOptions {
  CpuAdamKernel kernel = CpuAdamKernel::Auto;
  int threads = 0;  // 0 = OpenMP's default (OMP_NUM_THREADS)
};

// One AdamW step (Backend::adamw semantics) on n elements: fp32 `param`, `exp_avg` and
// `exp_avg_sq` are updated in place from `grad`, whose elements are of `grad_dtype` (F32, BF16 or
// F16). Throws when options.kernel is not supported here (see cpu_adam_kernel_supported).
void cpu_adamw(float* param, const void* grad, DType grad_dtype, float* exp_avg, float* exp_avg_sq,
               int64_t n, const Backend::AdamWArgs& args, const CpuAdamOptions& options = {});

// The same step with bf16 moments (bit patterns as uint16_t): each moment is widened to fp32,
// updated exactly as above, and rounded to nearest even back into bf16. Halves the moments' memory
// and traffic; not bitwise equal to the fp32-moment path.
void cpu_adamw_bf16_moments(float* param, const void* grad, DType grad_dtype, uint16_t* exp_avg,
                            uint16_t* exp_avg_sq, int64_t n, const Backend::AdamWArgs& args,
                            const CpuAdamOptions& options = {});

}  // namespace shardtrain::optim
