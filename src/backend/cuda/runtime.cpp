// Devices, streams, events and error checking (include/shardtrain/backend/cuda.h).
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <utility>

#include "shardtrain/backend/cuda.h"
#include "shardtrain/core/error.h"
#include "shardtrain/core/units.h"
#include "stream_retirement.h"

namespace shardtrain::cuda {

namespace {

constexpr int kMaxDevices = 16;

cudaStream_t as_stream(void* handle) {
  return static_cast<cudaStream_t>(handle);
}
cudaEvent_t as_event(void* handle) {
  return static_cast<cudaEvent_t>(handle);
}

// Per thread and device: the stream kernels are issued on (nullptr = legacy default stream).
thread_local std::array<void*, kMaxDevices> tls_streams{};

// Runs `release` (a cudaStreamDestroy or cudaEventDestroy) with the handle's device current and
// restores the previous device. Never throws: it runs in destructors and move assignments.
template <typename Release>
void release_on_device(int device, Release release) {
  int previous = -1;
  const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device &&
                        cudaSetDevice(device) == cudaSuccess;
  release();
  if (switched) (void)cudaSetDevice(previous);
}

// Waits for the stream's work, has the backend forget it, and gives the handle back to the
// driver.
void destroy_stream(int device, void* handle) {
  release_on_device(device, [&] {
    const cudaError_t status = cudaStreamSynchronize(as_stream(handle));
    if (status != cudaSuccess && status != cudaErrorCudartUnloading)
      std::fprintf(stderr, "shardtrain: waiting for a stream before destroying it failed: %s\n",
                   cudaGetErrorString(status));
    forget_stream(device, as_stream(handle));
    (void)cudaStreamDestroy(as_stream(handle));
  });
}

int checked_device(int device) {
  if (device < 0) device = current_device();
  ST_CHECK(device < kMaxDevices, "CUDA device ", device, " is beyond the ", kMaxDevices,
           " devices this build supports");
  return device;
}

}  // namespace

void check(int status, const char* call, const char* file, int line) {
  if (status == cudaSuccess) return;
  const auto err = static_cast<cudaError_t>(status);
  // Clear the error so that later, unrelated checks do not report it again (sticky errors such
  // as an illegal address stay regardless).
  (void)cudaGetLastError();
  throw Error(shardtrain::detail::concat("CUDA error in ", call, " (", file, ":", line, "): ",
                                         cudaGetErrorName(err), ": ", cudaGetErrorString(err)));
}

// ---- devices --------------------------------------------------------------------------------

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

int current_device() {
  int device = 0;
  ST_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

void set_device(int device) {
  ST_CUDA_CHECK(cudaSetDevice(device));
}

int multiprocessor_count(int device) {
  // Read on every kernel launch, from any thread.
  static std::array<std::atomic<int>, kMaxDevices> cached{};
  device = checked_device(device);
  int count = cached[device].load(std::memory_order_relaxed);
  if (count == 0) {
    ST_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
    cached[device].store(count, std::memory_order_relaxed);
  }
  return count;
}

int64_t shared_memory_per_block_optin(int device) {
  int bytes = 0;
  ST_CUDA_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                       checked_device(device)));
  return bytes;
}

int64_t total_memory(int device) {
  cudaDeviceProp prop{};
  ST_CUDA_CHECK(cudaGetDeviceProperties(&prop, checked_device(device)));
  return static_cast<int64_t>(prop.totalGlobalMem);
}

std::string device_description(int device) {
  cudaDeviceProp prop{};
  ST_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  return shardtrain::detail::concat(prop.name, " (sm_", prop.major, prop.minor, ", ",
                                    prop.multiProcessorCount, " SMs, ",
                                    format_bytes(static_cast<int64_t>(prop.totalGlobalMem)), ")");
}

void synchronize_device(int device) {
  DeviceGuard guard(device);
  ST_CUDA_CHECK(cudaDeviceSynchronize());
}

DeviceGuard::DeviceGuard(int device) : previous_(current_device()), changed_(device != previous_) {
  if (changed_) set_device(device);
}

DeviceGuard::~DeviceGuard() {
  if (changed_) (void)cudaSetDevice(previous_);
}

// ---- streams --------------------------------------------------------------------------------

// A null handle names the legacy default stream of the *current* device, so the view's device is
// made current first.
void StreamView::synchronize() const {
  DeviceGuard guard(device_);
  ST_CUDA_CHECK(cudaStreamSynchronize(as_stream(handle_)));
}

bool StreamView::query() const {
  DeviceGuard guard(device_);
  const cudaError_t status = cudaStreamQuery(as_stream(handle_));
  if (status == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  ST_CUDA_CHECK(status);
  return true;
}

Stream::Stream(int device, int priority) : device_(device) {
  DeviceGuard guard(device);
  cudaStream_t stream = nullptr;
  ST_CUDA_CHECK(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, priority));
  handle_ = stream;
}

Stream::~Stream() {
  if (handle_ != nullptr) destroy_stream(device_, handle_);
}

Stream::Stream(Stream&& other) noexcept
    : handle_(std::exchange(other.handle_, nullptr)), device_(other.device_) {}

Stream& Stream::operator=(Stream&& other) noexcept {
  if (this != &other) {
    if (handle_ != nullptr) destroy_stream(device_, handle_);
    handle_ = std::exchange(other.handle_, nullptr);
    device_ = other.device_;
  }
  return *this;
}

StreamView current_stream(int device) {
  device = checked_device(device);
  return {tls_streams[device], device};
}

void set_current_stream(StreamView stream) {
  tls_streams[checked_device(stream.device())] = stream.handle();
}

StreamGuard::StreamGuard(StreamView stream)
    : previous_(current_stream(stream.device())), device_(stream.device()) {
  set_current_stream(stream);
}

StreamGuard::~StreamGuard() {
  tls_streams[previous_.device()] = previous_.handle();
}

// ---- events ---------------------------------------------------------------------------------

Event::Event(bool timing) : timing_(timing) {}

Event::~Event() {
  if (handle_ != nullptr)
    release_on_device(device_, [&] { (void)cudaEventDestroy(as_event(handle_)); });
}

Event::Event(Event&& other) noexcept
    : handle_(std::exchange(other.handle_, nullptr)),
      device_(other.device_),
      timing_(other.timing_) {}

Event& Event::operator=(Event&& other) noexcept {
  if (this != &other) {
    if (handle_ != nullptr)
      release_on_device(device_, [&] { (void)cudaEventDestroy(as_event(handle_)); });
    handle_ = std::exchange(other.handle_, nullptr);
    device_ = other.device_;
    timing_ = other.timing_;
  }
  return *this;
}

void Event::record(StreamView stream) {
  DeviceGuard guard(stream.device());
  if (handle_ == nullptr) {
    cudaEvent_t event = nullptr;
    ST_CUDA_CHECK(
        cudaEventCreateWithFlags(&event, timing_ ? cudaEventDefault : cudaEventDisableTiming));
    handle_ = event;
    device_ = stream.device();
  }
  ST_CHECK(device_ == stream.device(), "a CUDA event created on device ", device_,
           " cannot be recorded on a stream of device ", stream.device());
  ST_CUDA_CHECK(cudaEventRecord(as_event(handle_), as_stream(stream.handle())));
}

void Event::block(StreamView stream) const {
  if (handle_ == nullptr) return;  // never recorded: nothing to wait for
  DeviceGuard guard(stream.device());
  ST_CUDA_CHECK(cudaStreamWaitEvent(as_stream(stream.handle()), as_event(handle_), 0));
}

void Event::synchronize() const {
  if (handle_ != nullptr) ST_CUDA_CHECK(cudaEventSynchronize(as_event(handle_)));
}

bool Event::query() const {
  if (handle_ == nullptr) return true;
  const cudaError_t status = cudaEventQuery(as_event(handle_));
  if (status == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  ST_CUDA_CHECK(status);
  return true;
}

float Event::elapsed_ms(const Event& end) const {
  ST_CHECK(timing_ && end.timing_ && handle_ != nullptr && end.handle_ != nullptr,
           "elapsed_ms needs two recorded timing events");
  float ms = 0.0f;
  ST_CUDA_CHECK(cudaEventElapsedTime(&ms, as_event(handle_), as_event(end.handle_)));
  return ms;
}

}  // namespace shardtrain::cuda
