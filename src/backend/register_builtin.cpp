#include "builtin.h"
#include "cpu/cpu_backend.h"

namespace shardtrain::detail {

void register_builtin_backends() {
  static CpuBackend cpu_backend;
  register_backend(DeviceKind::CPU, &cpu_backend);
#ifdef SHARDTRAIN_HAVE_CUDA
  register_cuda_backend();
#endif
}

}  // namespace shardtrain::detail
