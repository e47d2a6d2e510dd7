// CudaBackend::nf4_dequantize: operand checks, then the kernel in kernels/nf4.cu on the current
// stream of the output's device.
#include "cuda_backend.h"
#include "nf4_kernels.h"
#include "shardtrain/backend/nf4_codebook.h"

namespace shardtrain::cuda {

void CudaBackend::nf4_dequantize(const Tensor& codes, const Tensor& absmax_q,
                                 const Tensor& absmax_scale, float offset, Tensor& out) {
  nf4::check_dequantize_operands(codes, absmax_q, absmax_scale, out);
  ST_CHECK(out.device().is_cuda(), "CUDA nf4_dequantize: output ", out.describe(),
           " is not on a GPU");
  const int device = out.device().index;
  DeviceGuard guard(device);
  kernels::nf4_dequantize(static_cast<const uint8_t*>(codes.data_ptr()),
                          static_cast<const uint8_t*>(absmax_q.data_ptr()),
                          static_cast<const float*>(absmax_scale.data_ptr()), offset,
                          out.data_ptr(), out.dtype(), out.numel(),
                          static_cast<cudaStream_t>(current_stream(device).handle()));
}

}  // namespace shardtrain::cuda
