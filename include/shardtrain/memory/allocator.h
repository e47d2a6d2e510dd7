// Allocators: one per device and one for the host pool, each with a MemoryLedger.
//
// A DataPtr owns one allocation and returns it to its allocator when destroyed, so a tensor's
// bytes are freed exactly when its last reference goes away (peak memory behaves as in PyTorch).
#pragma once
#include <cstddef>
#include <memory>
#include <mutex>

#include "shardtrain/core/device.h"
#include "shardtrain/memory/category.h"
#include "shardtrain/memory/stats.h"

namespace shardtrain {

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual Device device() const = 0;

  // Allocates `bytes` (aligned to 64) counted under `category`; throws OutOfMemoryError.
  void* allocate(size_t bytes, MemoryCategory category);
  void deallocate(void* ptr, size_t bytes, MemoryCategory category);

  // Moves counted bytes from one category to another (a buffer handed to a new owner).
  void recategorize(size_t bytes, MemoryCategory from, MemoryCategory to);

  MemoryStats stats() const;
  void reset_peak();
  // Caps the bytes in use (0 = no cap). On a GPU the physical memory is a cap as well.
  void set_capacity(int64_t bytes);
  // Returns cached but unused blocks to the system (caching allocators).
  virtual void empty_cache() {}

 protected:
  virtual void* raw_allocate(size_t bytes) = 0;  // nullptr on failure
  virtual void raw_deallocate(void* ptr, size_t bytes) = 0;
  virtual int64_t reserved_bytes() const { return ledger_.stats().total_in_use; }

  mutable std::mutex mutex_;
  MemoryLedger ledger_;
};

// The allocator of a device or of the host pool. CUDA allocators are registered by the CUDA
// backend when it is built; asking for one without it throws.
Allocator& allocator_for(Device device);
void register_allocator(Device device, Allocator* allocator);

// Copies bytes between any two devices (memcpy between host and CPU device; the CUDA backend
// registers its copy function). Synchronous unless a backend says otherwise.
using CopyFn = void (*)(void* dst, Device dst_device, const void* src, Device src_device,
                        size_t bytes);
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);
void register_cuda_copy(CopyFn fn);

// Sets bytes to zero on any device: memset where the CPU can address the memory; on a GPU the
// CUDA backend registers a memset queued on the current stream (no host buffer, no wait).
using ZeroFn = void (*)(void* dst, Device device, size_t bytes);
void zero_bytes(void* dst, Device device, size_t bytes);
void register_cuda_zero(ZeroFn fn);

// One owned allocation.
class DataPtr {
 public:
  DataPtr() = default;
  DataPtr(size_t bytes, Device device, MemoryCategory category);
  // Wraps memory the caller owns (e.g. a memory-mapped file); never freed, never counted.
  static DataPtr borrowed(void* ptr, size_t bytes, Device device);
  ~DataPtr();
  DataPtr(DataPtr&& other) noexcept;
  DataPtr& operator=(DataPtr&& other) noexcept;
  DataPtr(const DataPtr&) = delete;
  DataPtr& operator=(const DataPtr&) = delete;

  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }
  MemoryCategory category() const { return category_; }
  // Counts this allocation under another category from now on.
  void set_category(MemoryCategory category);

 private:
  void reset();
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  Device device_;
  MemoryCategory category_ = MemoryCategory::Activations;
  bool owned_ = false;
};

}  // namespace shardtrain
