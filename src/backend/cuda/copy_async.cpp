// cuda::copy_async (include/shardtrain/backend/cuda.h).
#include <cuda_runtime.h>

#include "shardtrain/backend/cuda.h"

namespace shardtrain::cuda {

void copy_async(void* dst, const void* src, size_t bytes, StreamView stream) {
  if (bytes == 0) return;
  DeviceGuard guard(stream.device());
  ST_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault,
                                static_cast<cudaStream_t>(stream.handle())));
}

}  // namespace shardtrain::cuda
