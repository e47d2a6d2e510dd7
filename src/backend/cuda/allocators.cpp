#include "allocators.h"

#include <cstdio>
#include <iterator>
#include <utility>
#include <vector>

#include "shardtrain/core/error.h"

namespace shardtrain::cuda {

namespace {

uintptr_t stream_key(StreamView stream) {
  return reinterpret_cast<uintptr_t>(stream.handle());
}

// Errors on free paths are reported, not thrown: they run inside destructors.
void warn(cudaError_t status, const char* what) {
  if (status == cudaSuccess || status == cudaErrorCudartUnloading) return;
  std::fprintf(stderr, "shardtrain: %s failed: %s\n", what, cudaGetErrorString(status));
}

}  // namespace

// ---- device memory --------------------------------------------------------------------------

void* CudaCachingAllocator::DeviceMemory::allocate(size_t bytes) {
  DeviceGuard guard(device_);
  void* ptr = nullptr;
  if (cudaMalloc(&ptr, bytes) != cudaSuccess) {
    (void)cudaGetLastError();  // an out-of-memory error must not surface at the next check
    return nullptr;
  }
  return ptr;
}

void CudaCachingAllocator::DeviceMemory::release(void* ptr) {
  DeviceGuard guard(device_);
  warn(cudaFree(ptr), "cudaFree");
}

CudaCachingAllocator::CudaCachingAllocator(int device)
    : device_(device), raw_(device), pool_(raw_) {}

// The allocator registry keeps its allocators for the life of the process (tensors freed at exit
// still return memory to them), so this runs only for one built and dropped on its own. The
// events it created go back to the driver; the blocks go with the pool.
CudaCachingAllocator::~CudaCachingAllocator() {
  for (const DeferredFree& d : deferred_)
    for (cudaEvent_t event : d.events) warn(cudaEventDestroy(event), "cudaEventDestroy");
  for (cudaEvent_t event : spare_events_) warn(cudaEventDestroy(event), "cudaEventDestroy");
}

cudaEvent_t CudaCachingAllocator::take_event() {
  if (!spare_events_.empty()) {
    cudaEvent_t event = spare_events_.back();
    spare_events_.pop_back();
    return event;
  }
  cudaEvent_t event = nullptr;
  ST_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  return event;
}

void CudaCachingAllocator::process_deferred(bool wait) {
  for (auto it = deferred_.begin(); it != deferred_.end();) {
    bool done = true;
    for (cudaEvent_t event : it->events) {
      const cudaError_t status = wait ? cudaEventSynchronize(event) : cudaEventQuery(event);
      if (status == cudaErrorNotReady) {
        (void)cudaGetLastError();
        done = false;
        break;
      }
      warn(status, "waiting for a deferred free");
    }
    if (!done) {
      ++it;
      continue;
    }
    for (cudaEvent_t event : it->events) spare_events_.push_back(event);
    pool_.free(it->ptr);
    it = deferred_.erase(it);
  }
}

void* CudaCachingAllocator::raw_allocate(size_t bytes) {
  // Called by Allocator::allocate with mutex_ held.
  DeviceGuard guard(device_);
  const uintptr_t stream = stream_key(current_stream(device_));
  if (!deferred_.empty()) process_deferred(false);
  void* ptr = pool_.allocate(bytes, stream);
  if (ptr == nullptr) {
    // The driver refused: give back everything cached (other streams' blocks included) and
    // try once more before reporting out of memory.
    process_deferred(true);
    pool_.release_cached();
    ptr = pool_.allocate(bytes, stream);
  }
  sync_reserved();
  return ptr;
}

void CudaCachingAllocator::raw_deallocate(void* ptr, size_t) {
  // Called by Allocator::deallocate with mutex_ held; must not throw (runs in destructors).
  auto uses = extra_streams_.find(ptr);
  if (uses == extra_streams_.end()) {
    pool_.free(ptr);
    return;
  }
  DeferredFree deferred{ptr, {}};
  try {
    DeviceGuard guard(device_);
    for (cudaStream_t stream : uses->second) {
      cudaEvent_t event = take_event();
      deferred.events.push_back(event);
      ST_CUDA_CHECK(cudaEventRecord(event, stream));
    }
    deferred_.push_back(std::move(deferred));
  } catch (const std::exception& e) {
    // Without an event the only safe reuse is after the device is idle.
    std::fprintf(stderr, "shardtrain: recording a deferred free failed (%s); synchronising\n",
                 e.what());
    warn(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    for (cudaEvent_t event : deferred.events) spare_events_.push_back(event);
    pool_.free(ptr);
  }
  extra_streams_.erase(uses);
}

void CudaCachingAllocator::record_stream(const void* ptr, StreamView stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  detail::BlockPool::BlockInfo info;
  ST_CHECK(pool_.find(ptr, &info), "record_stream: ", ptr,
           " is not memory allocated by the caching allocator of cuda:", device_);
  ST_CHECK(stream.device() == device_, "record_stream: memory of cuda:", device_,
           " cannot be ordered after a stream of cuda:", stream.device(),
           " (events do not cross devices); use one device per process");
  if (info.stream == stream_key(stream)) return;
  auto& streams = extra_streams_[info.start];
  const auto handle = static_cast<cudaStream_t>(stream.handle());
  for (cudaStream_t s : streams)
    if (s == handle) return;
  streams.push_back(handle);
}

void CudaCachingAllocator::forget_stream(cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = extra_streams_.begin(); it != extra_streams_.end();) {
    std::erase(it->second, stream);
    it = it->second.empty() ? extra_streams_.erase(it) : std::next(it);
  }
}

void CudaCachingAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  DeviceGuard guard(device_);
  process_deferred(true);
  pool_.release_cached();
  sync_reserved();
  ledger_.set_reserved(reserved_bytes());
}

// ---- pinned host memory ---------------------------------------------------------------------

void* PinnedHostAllocator::PinnedMemory::allocate(size_t bytes) {
  void* ptr = nullptr;
  // Portable: pinned for every device's context, not only the current one.
  if (cudaHostAlloc(&ptr, bytes, cudaHostAllocPortable) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return ptr;
}

void PinnedHostAllocator::PinnedMemory::release(void* ptr) {
  warn(cudaFreeHost(ptr), "cudaFreeHost");
}

PinnedHostAllocator::PinnedHostAllocator(Allocator* previous) : previous_(previous), pool_(raw_) {
  if (previous_ == nullptr) return;
  // Bytes the previous allocator has out are freed through this one later; count them here so
  // that those frees balance.
  const MemoryStats before = previous_->stats();
  for (int c = 0; c < kNumMemoryCategories; ++c)
    if (before.in_use[c] > 0)
      ledger_.charge_unchecked(before.in_use[c], static_cast<MemoryCategory>(c));
  ledger_.set_capacity(before.capacity);
}

void* PinnedHostAllocator::raw_allocate(size_t bytes) {
  void* ptr = pool_.allocate(bytes, 0);
  if (ptr == nullptr) {
    pool_.release_cached();
    ptr = pool_.allocate(bytes, 0);
  }
  reserved_.store(pool_.reserved_bytes());
  return ptr;
}

void PinnedHostAllocator::raw_deallocate(void* ptr, size_t bytes) {
  if (pool_.free(ptr)) return;
  // Allocated by the allocator this one replaced (before the CUDA backend was registered).
  if (previous_ != nullptr) previous_->deallocate(ptr, bytes, CategoryScope::current());
}

void PinnedHostAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  pool_.release_cached();
  reserved_.store(pool_.reserved_bytes());
  ledger_.set_reserved(reserved_bytes());
}

}  // namespace shardtrain::cuda
