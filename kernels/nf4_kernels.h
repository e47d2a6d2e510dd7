// Host-side entry point of the NF4 dequantization kernel (kernels/nf4.cu), called by the CUDA
// backend's nf4_dequantize. Same conventions as kernels.h: work is enqueued on `stream`, pointers
// are device pointers of the current device.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "shardtrain/core/dtype.h"

namespace shardtrain::kernels {

// out[0, n) (dtype out_type: F32, BF16 or F16) = NF4 weights rebuilt from codes [ceil(n/2)],
// absmax_q [ceil(n/64)], absmax_scale [ceil(n/64/256)] and `offset`, with the formula of
// backend/nf4_codebook.h (bitwise equal to the CPU backend).
void nf4_dequantize(const uint8_t* codes, const uint8_t* absmax_q, const float* absmax_scale,
                    float offset, void* out, DType out_type, int64_t n, cudaStream_t stream);

}  // namespace shardtrain::kernels
