// The CUDA device caching allocator and the pinned host-pool allocator.
//
// Both keep freed blocks in a BlockPool (see block_pool.h for size classes, splitting and
// merging) instead of returning them to the driver: cudaMalloc/cudaFree synchronise the device
// and cudaHostAlloc pins pages, all far too slow to do per tensor. The ledger of the Allocator
// base class counts bytes in use per category; reserved_bytes() reports what the pool holds from
// the driver, which is what the GPU actually has committed.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <deque>
#include <unordered_map>
#include <vector>

#include "block_pool.h"
#include "shardtrain/backend/cuda.h"
#include "shardtrain/memory/allocator.h"

namespace shardtrain::cuda {

class CudaCachingAllocator final : public Allocator {
 public:
  explicit CudaCachingAllocator(int device);
  ~CudaCachingAllocator() override;
  CudaCachingAllocator(const CudaCachingAllocator&) = delete;
  CudaCachingAllocator& operator=(const CudaCachingAllocator&) = delete;
  Device device() const override { return Device::cuda(device_); }

  // Waits for deferred frees, then returns every fully free segment to the driver.
  void empty_cache() override;
  // See cuda::record_stream in the public header.
  void record_stream(const void* ptr, StreamView stream);
  // `stream` is being destroyed and its work has finished (stream_retirement.h): pending frees
  // stop waiting on it. Blocks cached for it stay cached, safe to hand to whichever stream
  // gets the handle next; empty_cache or an out-of-memory retry returns them to the driver.
  void forget_stream(cudaStream_t stream);

 protected:
  // Serves from the current stream's cached blocks, else cudaMalloc; when the driver refuses,
  // waits for deferred frees, releases the cache and retries once; nullptr if that fails too
  // (Allocator::allocate then throws OutOfMemoryError).
  void* raw_allocate(size_t bytes) override;
  void raw_deallocate(void* ptr, size_t bytes) override;
  int64_t reserved_bytes() const override { return reserved_.load(); }

 private:
  class DeviceMemory : public detail::RawMemory {
   public:
    explicit DeviceMemory(int device) : device_(device) {}
    void* allocate(size_t bytes) override;
    void release(void* ptr) override;

   private:
    int device_;
  };

  // A free whose block was used on other streams: it waits for these events.
  struct DeferredFree {
    void* ptr;
    std::vector<cudaEvent_t> events;
  };

  // Completes deferred frees whose events have fired (all of them, waiting, when `wait`).
  void process_deferred(bool wait);
  cudaEvent_t take_event();
  void sync_reserved() { reserved_.store(pool_.reserved_bytes()); }

  int device_;
  DeviceMemory raw_;
  detail::BlockPool pool_;
  std::unordered_map<void*, std::vector<cudaStream_t>> extra_streams_;  // by block start
  std::deque<DeferredFree> deferred_;
  std::vector<cudaEvent_t> spare_events_;
  std::atomic<int64_t> reserved_{0};  // read by reserved_bytes() without the lock
};

// The host pool (Device::host()) in page-locked memory, so that copies between it and a GPU run
// at full bus speed and offloaded tensors can be copied asynchronously. Frees are immediate:
// code that copies asynchronously from or to host tensors keeps them alive until the copy has
// finished (the copy functions of this backend are synchronous).
class PinnedHostAllocator final : public Allocator {
 public:
  // `previous` is the host-pool allocator being replaced. Its bytes in use are taken over by this
  // ledger, and memory it handed out before the replacement is returned to it when freed.
  explicit PinnedHostAllocator(Allocator* previous);
  Device device() const override { return Device::host(); }
  void empty_cache() override;

 protected:
  void* raw_allocate(size_t bytes) override;
  void raw_deallocate(void* ptr, size_t bytes) override;
  int64_t reserved_bytes() const override { return reserved_.load(); }

 private:
  class PinnedMemory : public detail::RawMemory {
   public:
    void* allocate(size_t bytes) override;
    void release(void* ptr) override;
  };

  Allocator* previous_;
  PinnedMemory raw_;
  detail::BlockPool pool_;
  std::atomic<int64_t> reserved_{0};
};

// The caching allocator of a device (throws when the CUDA backend has not registered one).
CudaCachingAllocator& device_allocator(int device);

}  // namespace shardtrain::cuda
