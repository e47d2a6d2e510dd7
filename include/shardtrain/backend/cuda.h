// CUDA runtime resources (devices, streams, events) as RAII types, usable from code that does
// not include the CUDA headers: handles are opaque pointers (a cudaStream_t or cudaEvent_t
// underneath) that only the CUDA backend's sources interpret.
//
// In a build without CUDA these declarations exist but have no definitions; code that calls them
// must be compiled only when SHARDTRAIN_HAVE_CUDA is defined (or guard on
// cuda_backend_available() and link a CUDA build).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "shardtrain/core/dtype.h"

namespace shardtrain::cuda {

// ---- errors ---------------------------------------------------------------------------------

// Throws shardtrain::Error naming the failed call, the CUDA error string and the source location
// when `status` (a cudaError_t) is not cudaSuccess.
void check(int status, const char* call, const char* file, int line);

}  // namespace shardtrain::cuda

// Wraps a CUDA runtime call: ST_CUDA_CHECK(cudaMemcpy(...)).
#define ST_CUDA_CHECK(call) \
  ::shardtrain::cuda::check(static_cast<int>(call), #call, __FILE__, __LINE__)

namespace shardtrain::cuda {

// ---- devices --------------------------------------------------------------------------------

// Number of usable devices; 0 when there is no driver, no device, or any other error.
int device_count();
int current_device();
void set_device(int device);
// "NVIDIA H100 80GB HBM3 (sm_90, 132 SMs, 79.1 GiB)".
std::string device_description(int device);
int multiprocessor_count(int device);
// Physical memory of `device` in bytes (what the memory planner may use).
int64_t total_memory(int device);
// The most shared memory one block may opt into on `device` (-1: the current one): 227 KiB on an
// H100, 163 KiB on an A100, 99 KiB on compute capability 8.6 and 8.9.
int64_t shared_memory_per_block_optin(int device);
// Whether the fused attention runs on its tensor-core kernels on `device` for this dtype and head
// dim: cuda_attention_uses_tensor_cores (backend/attention.h), and the kernels' shared memory
// fits the device (the head-dim-128 tiles take 102 KiB). Otherwise the CUDA-core kernels run.
bool attention_uses_tensor_cores(int device, DType type, int64_t head_dim);
// Waits for all work on `device`.
void synchronize_device(int device);

// RAII: makes `device` current on this thread and restores the previous one when destroyed.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_;
  bool changed_;
};

// ---- streams --------------------------------------------------------------------------------

// A non-owning reference to a stream on a device. A null handle is the device's legacy default
// stream, which orders itself with every other blocking stream.
class StreamView {
 public:
  StreamView() = default;
  StreamView(void* handle, int device) : handle_(handle), device_(device) {}
  void* handle() const { return handle_; }
  int device() const { return device_; }
  void synchronize() const;
  bool query() const;  // true when all work submitted so far has finished
  bool operator==(const StreamView& o) const {
    return handle_ == o.handle_ && device_ == o.device_;
  }

 private:
  void* handle_ = nullptr;
  int device_ = 0;
};

// An owned stream (non-blocking with respect to the default stream).
class Stream {
 public:
  explicit Stream(int device, int priority = 0);
  ~Stream();
  Stream(Stream&& other) noexcept;
  Stream& operator=(Stream&& other) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  StreamView view() const { return {handle_, device_}; }
  void* handle() const { return handle_; }
  int device() const { return device_; }
  void synchronize() const { view().synchronize(); }

 private:
  void* handle_ = nullptr;
  int device_ = 0;
};

// The stream kernels for `device` (default: the current device) are issued on by this thread.
// Each thread starts on the device's legacy default stream.
StreamView current_stream(int device = -1);
void set_current_stream(StreamView stream);

// RAII: makes `stream` this thread's current stream for its device (and its device current).
class StreamGuard {
 public:
  explicit StreamGuard(StreamView stream);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  StreamView previous_;
  DeviceGuard device_;
};

// ---- events ---------------------------------------------------------------------------------

class Event {
 public:
  // Timing events measure elapsed time; plain events are cheaper for synchronisation.
  explicit Event(bool timing = false);
  ~Event();
  Event(Event&& other) noexcept;
  Event& operator=(Event&& other) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  // Records the event on `stream` (the event is created on the stream's device at first use).
  void record(StreamView stream);
  // Makes `stream` wait until the work before the last record() has finished.
  void block(StreamView stream) const;
  void synchronize() const;
  bool query() const;
  // Milliseconds between this event and `end` (both recorded, timing events).
  float elapsed_ms(const Event& end) const;
  void* handle() const { return handle_; }

 private:
  void* handle_ = nullptr;
  int device_ = -1;
  bool timing_;
};

// ---- memory ---------------------------------------------------------------------------------

// Tells the caching allocator that device memory at `ptr` (from allocator_for(Device::cuda(i)))
// is used by work on `stream`, which is not the stream it was allocated on. When the memory is
// freed, it is reused only after the work queued on `stream` up to that point has finished.
void record_stream(const void* ptr, StreamView stream);

// Queues a copy of `bytes` from `src` to `dst` on `stream` and returns without waiting for it.
// Either side may be device memory or host memory (the runtime tells them apart). The caller
// keeps both buffers alive, and `src` unchanged, until the copy has finished (an Event recorded
// on `stream` after it). The host does not wait only when its side is page-locked, as the host
// pool is in a CUDA build; with pageable memory the runtime may finish the copy before returning.
void copy_async(void* dst, const void* src, size_t bytes, StreamView stream);

}  // namespace shardtrain::cuda
