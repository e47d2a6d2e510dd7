// A stand-in for the CUDA runtime library, so that the CUDA backend (src/backend/cuda) runs on
// the CPU with the kernels on the simt emulator. One device, or SHARDTRAIN_SIMT_DEVICES of them
// (so that several ranks of an mpirun job on one machine each find their own, as on a GPU node),
// each "sm_90" with 2 multiprocessors and 4 GiB; device memory is host memory, tracked per device
// so that pointer queries, bounds and the memory limit behave as on a GPU. Every call completes
// before it returns: streams and events exist as handles, are always idle, and impose no order of
// their own (work is already in program order). What this cannot model, and so what is not tested
// with it: work still queued on a stream while the host goes on (the allocator's cross-stream
// reuse, host callbacks that hold a stream back).
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

// The emulator's device limit (simt.h, which this file does not include: its macros are for
// kernel code).
namespace simt {
size_t shared_memory_per_block_optin();
}  // namespace simt

struct CUstream_st {
  int priority = 0;
};

struct CUevent_st {
  bool timing = true;
  bool recorded = false;
  std::chrono::steady_clock::time_point when{};
};

namespace {

constexpr size_t kDeviceMemory = size_t{4} << 30;
// Few, so that the kernels' grid-stride loops (grids capped at 16 blocks per multiprocessor)
// loop on test-sized inputs.
constexpr int kMultiprocessors = 2;

// The devices this process sees: SHARDTRAIN_SIMT_DEVICES (1 to 8), 1 when unset.
constexpr int kMaxDevices = 8;
int device_count() {
  static const int count = [] {
    const char* env = std::getenv("SHARDTRAIN_SIMT_DEVICES");
    if (env == nullptr || *env == '\0') return 1;
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    if (*end != '\0' || n < 1 || n > kMaxDevices) {
      std::fprintf(stderr, "fake CUDA runtime: SHARDTRAIN_SIMT_DEVICES='%s' is not 1 to %d\n", env,
                   kMaxDevices);
      std::abort();
    }
    return static_cast<int>(n);
  }();
  return count;
}

struct Block {
  size_t bytes = 0;
  int device = -1;  // the device a cudaMalloc block was allocated on; -1 for pinned host memory
};

struct Memory {
  std::mutex mutex;
  std::map<uintptr_t, Block> device;  // start -> every cudaMalloc block
  std::map<uintptr_t, Block> pinned;  // start -> every cudaHostAlloc block
  size_t device_used[kMaxDevices] = {};
};

Memory& memory() {
  static Memory m;
  return m;
}

thread_local int current_device = 0;

// The block of `blocks` that contains [p, p + bytes), or end() when p is in none.
std::map<uintptr_t, Block>::const_iterator containing(const std::map<uintptr_t, Block>& blocks,
                                                      const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  auto it = blocks.upper_bound(address);
  if (it == blocks.begin()) return blocks.end();
  --it;
  return address < it->first + it->second.bytes ? it : blocks.end();
}

// A copy or memset that starts inside a device block must end inside it: on a GPU the overrun
// would corrupt a neighbouring allocation or fault.
cudaError_t check_range(const void* p, size_t bytes, const char* what) {
  Memory& m = memory();
  std::lock_guard<std::mutex> lock(m.mutex);
  const auto it = containing(m.device, p);
  if (it == m.device.end()) return cudaSuccess;
  if (reinterpret_cast<uintptr_t>(p) + bytes > it->first + it->second.bytes) {
    std::fprintf(stderr, "fake CUDA runtime: %s of %zu bytes at %p runs past its allocation\n",
                 what, bytes, p);
    return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

cudaError_t check_device(int device) {
  return device >= 0 && device < device_count() ? cudaSuccess : cudaErrorInvalidDevice;
}

}  // namespace

// ---- devices --------------------------------------------------------------------------------

cudaError_t cudaGetDeviceCount(int* count) {
  *count = device_count();
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  *device = current_device;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (check_device(device) != cudaSuccess) return cudaErrorInvalidDevice;
  current_device = device;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (check_device(device) != cudaSuccess) return cudaErrorInvalidDevice;
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof(prop->name), "simt emulator");
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = kMultiprocessors;
  prop->totalGlobalMem = kDeviceMemory;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->sharedMemPerBlockOptin = simt::shared_memory_per_block_optin();
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (check_device(device) != cudaSuccess) return cudaErrorInvalidDevice;
  switch (attr) {
    case cudaDevAttrMultiProcessorCount:
      *value = kMultiprocessors;
      return cudaSuccess;
    case cudaDevAttrComputeCapabilityMajor:
      *value = 9;
      return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor:
      *value = 0;
      return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = static_cast<int>(simt::shared_memory_per_block_optin());
      return cudaSuccess;
    default:
      std::fprintf(stderr, "fake CUDA runtime: device attribute %d is not modelled\n",
                   static_cast<int>(attr));
      return cudaErrorInvalidValue;
  }
}

cudaError_t cudaDeviceSynchronize() {
  return cudaSuccess;
}

// ---- errors ---------------------------------------------------------------------------------

cudaError_t cudaGetLastError() {
  return cudaSuccess;
}

cudaError_t cudaPeekAtLastError() {
  return cudaSuccess;
}

const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle:
      return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotSupported:
      return "cudaErrorNotSupported";
    default:
      return "cudaErrorUnknown";
  }
}

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle:
      return "invalid resource handle";
    case cudaErrorNotSupported:
      return "operation not supported (by the fake CUDA runtime)";
    default:
      return "unknown error";
  }
}

// ---- memory ---------------------------------------------------------------------------------

cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  *ptr = nullptr;
  if (bytes == 0) return cudaSuccess;
  Memory& m = memory();
  std::lock_guard<std::mutex> lock(m.mutex);
  size_t& used = m.device_used[current_device];
  if (used + bytes > kDeviceMemory) return cudaErrorMemoryAllocation;
  const size_t rounded = (bytes + 255) / 256 * 256;  // cudaMalloc returns 256-byte aligned memory
  void* p = std::aligned_alloc(256, rounded);
  if (p == nullptr) return cudaErrorMemoryAllocation;
  std::memset(p, 0xff, rounded);  // device memory starts with garbage; make it NaN
  m.device[reinterpret_cast<uintptr_t>(p)] = Block{bytes, current_device};
  used += bytes;
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
  if (ptr == nullptr) return cudaSuccess;
  Memory& m = memory();
  std::lock_guard<std::mutex> lock(m.mutex);
  const auto it = m.device.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == m.device.end()) return cudaErrorInvalidValue;
  m.device_used[it->second.device] -= it->second.bytes;
  m.device.erase(it);
  std::free(ptr);
  return cudaSuccess;
}

cudaError_t cudaHostAlloc(void** ptr, size_t bytes, unsigned int) {
  const size_t rounded = (std::max<size_t>(bytes, 1) + 4095) / 4096 * 4096;
  *ptr = std::aligned_alloc(4096, rounded);
  if (*ptr == nullptr) return cudaErrorMemoryAllocation;
  Memory& m = memory();
  std::lock_guard<std::mutex> lock(m.mutex);
  m.pinned[reinterpret_cast<uintptr_t>(*ptr)] = Block{bytes, -1};
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void* ptr) {
  if (ptr == nullptr) return cudaSuccess;
  Memory& m = memory();
  std::lock_guard<std::mutex> lock(m.mutex);
  if (m.pinned.erase(reinterpret_cast<uintptr_t>(ptr)) == 0) return cudaErrorInvalidValue;
  std::free(ptr);
  return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attributes, const void* ptr) {
  *attributes = cudaPointerAttributes{};
  Memory& m = memory();
  std::lock_guard<std::mutex> lock(m.mutex);
  if (const auto it = containing(m.device, ptr); it != m.device.end()) {
    attributes->type = cudaMemoryTypeDevice;
    attributes->device = it->second.device;
    attributes->devicePointer = const_cast<void*>(ptr);
  } else if (containing(m.pinned, ptr) != m.pinned.end()) {
    attributes->type = cudaMemoryTypeHost;
    attributes->hostPointer = const_cast<void*>(ptr);
    attributes->devicePointer = const_cast<void*>(ptr);
  } else {
    attributes->type = cudaMemoryTypeUnregistered;
    attributes->device = -2;
  }
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind) {
  if (check_range(dst, bytes, "cudaMemcpy destination") != cudaSuccess ||
      check_range(src, bytes, "cudaMemcpy source") != cudaSuccess)
    return cudaErrorInvalidValue;
  std::memmove(dst, src, bytes);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t) {
  return cudaMemcpy(dst, src, bytes, kind);
}

cudaError_t cudaMemsetAsync(void* dst, int value, size_t bytes, cudaStream_t) {
  if (check_range(dst, bytes, "cudaMemsetAsync") != cudaSuccess) return cudaErrorInvalidValue;
  std::memset(dst, value, bytes);
  return cudaSuccess;
}

// ---- streams and events ---------------------------------------------------------------------

cudaError_t cudaStreamCreateWithPriority(cudaStream_t* stream, unsigned int, int priority) {
  *stream = new CUstream_st{priority};
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  delete stream;
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t) {
  return cudaSuccess;
}

cudaError_t cudaStreamQuery(cudaStream_t) {
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t event, unsigned int) {
  return event == nullptr ? cudaErrorInvalidResourceHandle : cudaSuccess;
}

// Holding a stream back until a host function returns cannot be expressed when every call
// completes at once; the tests that need it are not run on the emulator.
cudaError_t cudaLaunchHostFunc(cudaStream_t, cudaHostFn_t, void*) {
  return cudaErrorNotSupported;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  *event = new CUevent_st{};
  (*event)->timing = (flags & cudaEventDisableTiming) == 0;
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete event;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t) {
  if (event == nullptr) return cudaErrorInvalidResourceHandle;
  event->recorded = true;
  event->when = std::chrono::steady_clock::now();
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  return event == nullptr ? cudaErrorInvalidResourceHandle : cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  return event == nullptr ? cudaErrorInvalidResourceHandle : cudaSuccess;
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  if (start == nullptr || end == nullptr || !start->timing || !end->timing)
    return cudaErrorInvalidResourceHandle;
  if (!start->recorded || !end->recorded) return cudaErrorInvalidResourceHandle;
  *ms = std::chrono::duration<float, std::milli>(end->when - start->when).count();
  return cudaSuccess;
}
