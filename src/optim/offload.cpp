#include "shardtrain/optim/offload.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>

#include "shardtrain/autograd/node.h"
#include "shardtrain/memory/category.h"

#ifdef SHARDTRAIN_HAVE_CUDA
#include "shardtrain/backend/cuda.h"
#endif

namespace shardtrain::optim {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// A FIFO between two pipeline stages. close(): no more items, the reader drains what is there;
// abort(): a stage failed, everyone stops at once.
template <typename T>
class Channel {
 public:
  void push(T item) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (aborted_) return;
      items_.push_back(std::move(item));
    }
    ready_.notify_one();
  }
  // Waits for an item; false when the channel is closed and empty, or aborted.
  bool pop(T& out) {
    std::unique_lock<std::mutex> lock(mutex_);
    ready_.wait(lock, [&] { return aborted_ || closed_ || !items_.empty(); });
    if (aborted_ || items_.empty()) return false;
    out = std::move(items_.front());
    items_.pop_front();
    return true;
  }
  void close() { end(closed_); }
  void abort() { end(aborted_); }

 private:
  void end(bool& flag) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      flag = true;
    }
    ready_.notify_all();
  }
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<T> items_;
  bool closed_ = false, aborted_ = false;
};

// A range of one parameter's elements that travels through the pipeline as a unit.
struct Piece {
  size_t param;
  int64_t offset, count;
  Tensor grad;
};

// Host staging for one piece in flight.
struct Slot {
  Tensor grad;       // the gradient piece, in the gradient's dtype
  Tensor m, v;       // moment pieces (moments on the device only)
  Tensor param_out;  // the updated piece in the parameter's dtype (16-bit parameters only)
};

struct Item {
  size_t piece;
  size_t slot;
};

constexpr size_t kSlots = 3;  // one piece per stage

char* element_ptr(const Tensor& t, int64_t offset) {
  return static_cast<char*>(t.data_ptr()) + offset * static_cast<int64_t>(dtype_size(t.dtype()));
}

}  // namespace

struct OffloadedAdamW::Pipeline {
  // Staging, kept from step to step: allocating it afresh would cost page faults (CPU) or pinning
  // (GPU hosts without a caching pinned pool) every step. Grown when a step needs larger pieces.
  std::vector<Slot> slots;
  int64_t slot_elems = 0;
  bool with_moments = false, with_param_out = false;
#ifdef SHARDTRAIN_HAVE_CUDA
  int device = -1;
  std::optional<cuda::Stream> download, upload;
#endif
};

OffloadedAdamW::OffloadedAdamW(std::vector<NamedParam> params, AdamWOptions options,
                               OffloadOptions offload)
    : Optimizer(std::move(params)),
      options_(options),
      offload_(offload),
      pipeline_(std::make_unique<Pipeline>()) {
  ST_CHECK_AS(ConfigError, offload_.pipeline_chunk_elements > 0,
              "the offloaded optimizer's pipeline_chunk_elements must be positive, got ",
              offload_.pipeline_chunk_elements);
  CategoryScope scope(MemoryCategory::OptimizerState);
  for (auto& p : params_) {
    ST_CHECK(is_floating(p.param->dtype()), "OffloadedAdamW updates float parameters; '", p.name,
             "' is ", p.param->describe());
    master_.push_back(empty(p.param->shape(), DType::F32, Device::host()));
    const Device moments = offload_.moments_on_device ? p.param->device() : Device::host();
    exp_avg_.push_back(zeros(p.param->shape(), DType::F32, moments));
    exp_avg_sq_.push_back(zeros(p.param->shape(), DType::F32, moments));
    decay_.push_back(options_.decay_all || default_decay_filter(p.name));
  }
  read_masters();
  masters_stale_ = true;  // read again before the first step: weights may be loaded until then
}

OffloadedAdamW::~OffloadedAdamW() = default;

void OffloadedAdamW::read_masters() {
  CategoryScope scope(MemoryCategory::Workspace);  // conversion temporaries, if any
  for (size_t i = 0; i < params_.size(); ++i) master_[i].copy_from(*params_[i].param);
  masters_stale_ = false;
}

void OffloadedAdamW::reload_params() {
  masters_stale_ = true;
}

std::vector<std::pair<std::string, Tensor*>> OffloadedAdamW::state() {
  std::vector<std::pair<std::string, Tensor*>> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    out.emplace_back("exp_avg." + params_[i].name, &exp_avg_[i]);
    out.emplace_back("exp_avg_sq." + params_[i].name, &exp_avg_sq_[i]);
  }
  return out;
}

void OffloadedAdamW::update(float lr, float grad_scale) {
  const Clock::time_point start = Clock::now();
  if (masters_stale_) read_masters();
  stats_ = OffloadStepStats{};

  // ---- the pieces of this step ----
  std::vector<Piece> pieces;
  const int64_t chunk = offload_.pipeline_chunk_elements;
  int64_t slot_elems = 0;
  bool any_16bit_param = false;
  std::optional<Device> device;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = *params_[i].param;
    Tensor g = autograd::grad(p);
    if (!g.defined()) continue;
    ST_CHECK(g.numel() == p.numel() && g.device() == p.device() && is_floating(g.dtype()),
             "the gradient of '", params_[i].name, "' is ", g.describe(), " for parameter ",
             p.describe());
    ST_CHECK(!device || *device == p.device(),
             "OffloadedAdamW needs every parameter on one device; '", params_[i].name, "' is on ",
             p.device().str(), ", others on ", device->str());
    device = p.device();
    any_16bit_param = any_16bit_param || p.dtype() != DType::F32;
    for (int64_t off = 0; off < p.numel(); off += chunk)
      pieces.push_back({i, off, std::min(chunk, p.numel() - off), g});
    slot_elems = std::max(slot_elems, std::min(chunk, p.numel()));
  }
  // Counted like AdamW counts (even when no parameter has a gradient), once the gradients are
  // known to be usable. A failure further on (a copy) leaves the step partly applied, as it would
  // on the device.
  ++steps_;
  if (pieces.empty()) return;

  // ---- staging (host pool, Workspace) ----
  Pipeline& pipe = *pipeline_;
  if (pipe.slots.empty() || pipe.slot_elems < slot_elems ||
      pipe.with_moments != offload_.moments_on_device ||
      (any_16bit_param && !pipe.with_param_out)) {
    pipe.slots.clear();  // free the old staging before allocating the new
    pipe.slots.resize(kSlots);
    pipe.slot_elems = std::max(pipe.slot_elems, slot_elems);
    pipe.with_moments = offload_.moments_on_device;
    pipe.with_param_out = pipe.with_param_out || any_16bit_param;
    CategoryScope scope(MemoryCategory::Workspace);
    for (Slot& slot : pipe.slots) {
      // Sized for fp32; 16-bit pieces use the first half.
      slot.grad = empty({pipe.slot_elems}, DType::F32, Device::host());
      if (pipe.with_moments) {
        slot.m = empty({pipe.slot_elems}, DType::F32, Device::host());
        slot.v = empty({pipe.slot_elems}, DType::F32, Device::host());
      }
      if (pipe.with_param_out)
        slot.param_out = empty({pipe.slot_elems}, DType::F32, Device::host());
    }
  }
  std::vector<Slot>& slots = pipe.slots;

#ifdef SHARDTRAIN_HAVE_CUDA
  // Copies run on two streams of their own, after everything already queued on the caller's
  // stream (which produced the gradients and may still read the parameters).
  std::optional<cuda::Event> queued;
  if (device->is_cuda()) {
    if (pipe.device != device->index) {
      pipe.download.emplace(device->index);
      pipe.upload.emplace(device->index);
      pipe.device = device->index;
    }
    queued.emplace();
    queued->record(cuda::current_stream(device->index));
    queued->block(pipe.download->view());
    queued->block(pipe.upload->view());
  }
#endif

  const Device dev = *device;
  const Device host = Device::host();
  const bool moments_on_device = offload_.moments_on_device;
  Channel<size_t> free_slots;
  Channel<Item> to_update, to_upload;
  for (size_t s = 0; s < kSlots; ++s) free_slots.push(s);
  std::mutex error_mutex;
  std::exception_ptr error;
  auto fail = [&] {
    {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
    free_slots.abort();
    to_update.abort();
    to_upload.abort();
  };
  double download_s = 0, update_s = 0, upload_s = 0;
  int64_t bytes_down = 0, bytes_up = 0;

  auto download = [&] {
    try {
#ifdef SHARDTRAIN_HAVE_CUDA
      std::optional<cuda::StreamGuard> on_stream;
      if (dev.is_cuda()) on_stream.emplace(pipe.download->view());
#endif
      for (size_t k = 0; k < pieces.size(); ++k) {
        size_t s;
        if (!free_slots.pop(s)) return;
        const Piece& piece = pieces[k];
        const Clock::time_point t0 = Clock::now();
        const size_t gbytes = static_cast<size_t>(piece.count) * dtype_size(piece.grad.dtype());
        copy_bytes(slots[s].grad.data_ptr(), host, element_ptr(piece.grad, piece.offset), dev,
                   gbytes);
        bytes_down += static_cast<int64_t>(gbytes);
        if (moments_on_device) {
          const size_t mbytes = static_cast<size_t>(piece.count) * 4;
          copy_bytes(slots[s].m.data_ptr(), host, element_ptr(exp_avg_[piece.param], piece.offset),
                     dev, mbytes);
          copy_bytes(slots[s].v.data_ptr(), host,
                     element_ptr(exp_avg_sq_[piece.param], piece.offset), dev, mbytes);
          bytes_down += static_cast<int64_t>(2 * mbytes);
        }
        download_s += seconds_since(t0);
        to_update.push({k, s});
      }
      to_update.close();
    } catch (...) {
      fail();
    }
  };

  auto upload = [&] {
    try {
#ifdef SHARDTRAIN_HAVE_CUDA
      std::optional<cuda::StreamGuard> on_stream;
      if (dev.is_cuda()) on_stream.emplace(pipe.upload->view());
#endif
      Item item;
      while (to_upload.pop(item)) {
        const Piece& piece = pieces[item.piece];
        const Slot& slot = slots[item.slot];
        const Tensor& param = *params_[piece.param].param;
        const Clock::time_point t0 = Clock::now();
        const size_t pbytes = static_cast<size_t>(piece.count) * dtype_size(param.dtype());
        const void* src = param.dtype() == DType::F32
                              ? element_ptr(master_[piece.param], piece.offset)
                              : slot.param_out.data_ptr();
        copy_bytes(element_ptr(param, piece.offset), dev, src, host, pbytes);
        bytes_up += static_cast<int64_t>(pbytes);
        if (moments_on_device) {
          const size_t mbytes = static_cast<size_t>(piece.count) * 4;
          copy_bytes(element_ptr(exp_avg_[piece.param], piece.offset), dev, slot.m.data_ptr(), host,
                     mbytes);
          copy_bytes(element_ptr(exp_avg_sq_[piece.param], piece.offset), dev, slot.v.data_ptr(),
                     host, mbytes);
          bytes_up += static_cast<int64_t>(2 * mbytes);
        }
        upload_s += seconds_since(t0);
        free_slots.push(item.slot);
      }
    } catch (...) {
      fail();
    }
  };

  {
    // Declared after the channels and slots they use, so they are joined before those go away.
    std::jthread downloader, uploader;
    try {
      downloader = std::jthread(download);
      uploader = std::jthread(upload);
      Item item;
      while (to_update.pop(item)) {
        const Piece& piece = pieces[item.piece];
        const Slot& slot = slots[item.slot];
        const size_t i = piece.param;
        const Clock::time_point t0 = Clock::now();
        float* m =
            moments_on_device ? slot.m.data<float>() : exp_avg_[i].data<float>() + piece.offset;
        float* v =
            moments_on_device ? slot.v.data<float>() : exp_avg_sq_[i].data<float>() + piece.offset;
        float* master = master_[i].data<float>() + piece.offset;
        const Backend::AdamWArgs args{lr,
                                      options_.beta1,
                                      options_.beta2,
                                      options_.eps,
                                      decay_[i] ? options_.weight_decay : 0.0f,
                                      steps_,
                                      grad_scale};
        cpu_adamw(master, slot.grad.data_ptr(), piece.grad.dtype(), m, v, piece.count, args,
                  offload_.cpu);
        const DType pdtype = params_[i].param->dtype();
        if (pdtype != DType::F32)
          convert_elements(master, DType::F32, slot.param_out.data_ptr(), pdtype, piece.count);
        update_s += seconds_since(t0);
        to_upload.push(item);
      }
      to_upload.close();
    } catch (...) {
      fail();
    }
  }  // joins both copy threads
  if (error) std::rethrow_exception(error);

  stats_.download_seconds = download_s;
  stats_.update_seconds = update_s;
  stats_.upload_seconds = upload_s;
  stats_.bytes_down = bytes_down;
  stats_.bytes_up = bytes_up;
  stats_.pieces = static_cast<int64_t>(pieces.size());
  stats_.wall_seconds = seconds_since(start);
}

}  // namespace shardtrain::optim
