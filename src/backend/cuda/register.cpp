// Registration of the CUDA backend, its allocators and its copy and cast functions.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdio>

#include "../builtin.h"
#include "allocators.h"
#include "cuda_backend.h"
#include "shardtrain/core/error.h"
#include "stream_retirement.h"

namespace shardtrain {

namespace cuda {

namespace {

constexpr int kMaxDevices = 16;
std::array<CudaCachingAllocator*, kMaxDevices> g_allocators{};
CudaBackend* g_backend = nullptr;

// A device the kernels can run on: Ampere or newer (the build carries sm_80/sm_90 code, and the
// attention kernels use bf16 tensor-core instructions). Only attributes are read: since CUDA 12,
// cudaSetDevice and allocations create a context, which would cost every process memory on every
// GPU of the machine (FSDP runs one process per GPU).
bool usable(int device) {
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return major >= 8;
}

}  // namespace

CudaCachingAllocator& device_allocator(int device) {
  ST_CHECK(device >= 0 && device < kMaxDevices && g_allocators[device] != nullptr,
           "no CUDA caching allocator for cuda:", device,
           ": the device does not exist or the CUDA backend is not registered");
  return *g_allocators[device];
}

void record_stream(const void* ptr, StreamView stream) {
  // The allocator that owns the memory, which need not be the stream's device's.
  cudaPointerAttributes attributes{};
  ST_CUDA_CHECK(cudaPointerGetAttributes(&attributes, ptr));
  ST_CHECK(attributes.type == cudaMemoryTypeDevice, "record_stream: ", ptr,
           " is not device memory");
  device_allocator(attributes.device).record_stream(ptr, stream);
}

void forget_stream(int device, cudaStream_t stream) noexcept {
  if (device >= 0 && device < kMaxDevices && g_allocators[device] != nullptr)
    g_allocators[device]->forget_stream(stream);
  if (g_backend != nullptr) g_backend->forget_stream(device, stream);
}

}  // namespace cuda

namespace detail {

void register_cuda_backend() {
  // Any error (no driver: "CUDA driver version is insufficient"; no device; a device that cannot
  // run this build) means no GPU: register nothing and let the CPU backend serve alone.
  const int count = std::min(cuda::device_count(), cuda::kMaxDevices);
  int registered = 0;
  for (int i = 0; i < count; ++i) {
    if (!cuda::usable(i)) {
      std::fprintf(stderr,
                   "shardtrain: ignoring CUDA device %d (needs compute capability 8.0 or "
                   "newer)\n",
                   i);
      continue;
    }
    // Allocators and the backend live until the process exits: destroying them during static
    // destruction would race with the CUDA runtime's own teardown.
    cuda::g_allocators[i] = new cuda::CudaCachingAllocator(i);
    register_allocator(Device::cuda(i), cuda::g_allocators[i]);
    ++registered;
  }
  if (registered == 0) return;
  register_allocator(Device::host(), new cuda::PinnedHostAllocator(&allocator_for(Device::host())));
  register_cuda_copy(&cuda::copy_between_devices);
  register_cuda_zero(&cuda::zero_on_device);
  register_device_cast(&cuda::cast_on_device);
  cuda::g_backend = new cuda::CudaBackend();
  register_backend(DeviceKind::CUDA, cuda::g_backend);
}

}  // namespace detail

}  // namespace shardtrain
