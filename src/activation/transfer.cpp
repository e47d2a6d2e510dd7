#include "transfer.h"

#include <chrono>
#include <map>
#include <mutex>

#include "shardtrain/activation/counters.h"
#include "shardtrain/memory/category.h"

#ifdef SHARDTRAIN_HAVE_CUDA
#include "shardtrain/backend/cuda.h"
#endif

namespace shardtrain::activation::detail {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// A copy that was complete when it was made.
class FinishedCopy final : public Copy {
 public:
  bool finished() override { return true; }
  void wait() override {}
  void order_use(const Tensor&) override {}
  void order_release(const Tensor&) override {}
};

class SynchronousTransfers final : public Transfers {
 public:
  Moved to_host(const Tensor& src) override {
    return copy(src, Device::host(), MemoryCategory::Offloaded);
  }
  Moved to_device(const Tensor& host, Device device, Copy&) override {
    return copy(host, device, MemoryCategory::Activations);
  }

 private:
  static Moved copy(const Tensor& src, Device device, MemoryCategory category) {
    const Clock::time_point start = Clock::now();
    Tensor out = src.to(device, category);
    count_copy(seconds_since(start));
    return {std::move(out), std::make_unique<FinishedCopy>()};
  }
};

#ifdef SHARDTRAIN_HAVE_CUDA

// The copy streams of one GPU: device-to-host and host-to-device on separate streams, so the two
// directions use separate copy engines and overlap each other as well as compute. Shared by
// every OffloadHooks of the process and never destroyed: the caching allocator remembers the
// to-host stream of every block it was told about (record_stream) and records an event on it
// when that block is freed, which can happen after every OffloadHooks is gone. Like the
// allocators, they live until the process exits.
struct CopyStreams {
  cuda::Stream to_host;
  cuda::Stream to_device;
};

CopyStreams& copy_streams(int device) {
  static std::mutex mutex;
  static std::map<int, CopyStreams*> streams;
  std::lock_guard<std::mutex> lock(mutex);
  CopyStreams*& s = streams[device];
  if (s == nullptr) s = new CopyStreams{cuda::Stream(device), cuda::Stream(device)};
  return *s;
}

// A copy queued on a copy stream between two timing events; `end` is its completion.
class CudaCopy final : public Copy {
 public:
  // `owner`: for a copy to the device, the stream its destination was allocated for.
  explicit CudaCopy(cuda::StreamView owner) : owner_(owner) {}

  bool finished() override {
    if (!end_.query()) return false;
    count();
    return true;
  }

  void wait() override {
    end_.synchronize();
    count();
  }

  void order_use(const Tensor& result) override {
    const cuda::StreamView stream = cuda::current_stream(result.device().index);
    end_.block(stream);
    if (stream == owner_) {
      owner_ordered_ = true;
    } else {
      // Used on a stream its memory does not belong to: the block's reuse must also wait for
      // what that stream does with it.
      cuda::record_stream(result.data_ptr(), stream);
    }
  }

  void order_release(const Tensor&) override {
    // The caching allocator gives a block freed on its owner stream to the next request there at
    // once, which is safe only if the owner stream has waited for the copy that writes it.
    if (owner_ordered_) return;
    end_.block(owner_);
    owner_ordered_ = true;
  }

  cuda::Event& start() { return start_; }
  cuda::Event& end() { return end_; }

 private:
  void count() {
    if (counted_) return;
    counted_ = true;
    count_copy(static_cast<double>(start_.elapsed_ms(end_)) / 1000.0);
  }

  cuda::StreamView owner_;
  cuda::Event start_{true};
  cuda::Event end_{true};
  bool owner_ordered_ = false;
  bool counted_ = false;
};

// Copies on the device's copy streams. Every copy waits (on the GPU, not the host) for the work
// queued on the compute stream when it was issued; a copy to the device also waits for the copy
// that filled its host buffer. Nothing here waits on the host, except when a tensor to offload is
// not memory of the caching allocator.
class CudaTransfers final : public Transfers {
 public:
  explicit CudaTransfers(int device) : device_(device), streams_(copy_streams(device)) {}

  Moved to_host(const Tensor& src) override {
    if (src.nbytes() == 0) return sync_->to_host(src);
    Tensor host;
    {
      CategoryScope category(MemoryCategory::Offloaded);
      host = empty(src.shape(), src.dtype(), Device::host());
    }
    const cuda::StreamView stream = streams_.to_host.view();
    auto copy = std::make_unique<CudaCopy>(cuda::StreamView());
    // The copy reads what the compute stream has produced so far.
    after_compute(stream);
    copy->start().record(stream);
    queue(stream, host.data_ptr(), src.data_ptr(), src.nbytes(), *copy);
    // src's memory belongs to the compute stream, where the caching allocator hands it out again
    // as soon as it is freed; this makes that reuse wait for the copy as well.
    try {
      cuda::record_stream(src.data_ptr(), stream);
    } catch (const Error&) {
      // Not a block of the caching allocator (borrowed memory): nothing can defer its reuse, so
      // the copy finishes before the caller may free it.
      copy->wait();
    }
    return {std::move(host), std::move(copy)};
  }

  Moved to_device(const Tensor& host, Device device, Copy& filled) override {
    ST_CHECK(device == Device::cuda(device_), "offload copies for cuda:", device_,
             " asked to restore a tensor on ", device.str());
    if (host.nbytes() == 0) return sync_->to_device(host, device, filled);
    const cuda::StreamView compute = cuda::current_stream(device_);
    Tensor out;
    {
      CategoryScope category(MemoryCategory::Activations);
      out = empty(host.shape(), host.dtype(), device);  // a block of `compute`
    }
    const cuda::StreamView stream = streams_.to_device.view();
    auto copy = std::make_unique<CudaCopy>(compute);
    // The block may have been freed on `compute` while work queued there still uses it (the
    // caching allocator reuses a block on its own stream at once), so it is written only after
    // that work ...
    after_compute(stream);
    // ... and after the copy that filled the host buffer (long finished, normally).
    if (auto* to_host = dynamic_cast<CudaCopy*>(&filled)) to_host->end().block(stream);
    copy->start().record(stream);
    queue(stream, out.data_ptr(), host.data_ptr(), host.nbytes(), *copy);
    return {std::move(out), std::move(copy)};
  }

 private:
  // Makes `stream` wait for the work queued on the compute stream so far.
  void after_compute(cuda::StreamView stream) {
    compute_point_.record(cuda::current_stream(device_));
    compute_point_.block(stream);
  }

  // Queues the copy and its end event. If that fails once the copy may be queued, waits for the
  // stream, so that no copy still reads or writes buffers the caller frees while unwinding.
  static void queue(cuda::StreamView stream, void* dst, const void* src, size_t bytes,
                    CudaCopy& copy) {
    try {
      cuda::copy_async(dst, src, bytes, stream);
      copy.end().record(stream);
    } catch (...) {
      try {
        stream.synchronize();
      } catch (...) {
        // The first error is the one worth reporting.
      }
      throw;
    }
  }

  int device_;
  CopyStreams& streams_;
  // Re-recorded for every copy: a stream that waited on it keeps waiting for the work before
  // the record it saw, whatever is recorded later.
  cuda::Event compute_point_;
  std::unique_ptr<Transfers> sync_ = synchronous_transfers();
};

#endif  // SHARDTRAIN_HAVE_CUDA

}  // namespace

std::unique_ptr<Transfers> synchronous_transfers() {
  return std::make_unique<SynchronousTransfers>();
}

std::unique_ptr<Transfers> make_transfers(Device device, OffloadCopies copies) {
#ifdef SHARDTRAIN_HAVE_CUDA
  if (device.is_cuda() && copies == OffloadCopies::Overlapped)
    return std::make_unique<CudaTransfers>(device.index);
#else
  (void)device;
  (void)copies;
#endif
  return synchronous_transfers();
}

}  // namespace shardtrain::activation::detail
