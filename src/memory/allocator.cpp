#include "shardtrain/memory/allocator.h"

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <unordered_map>
#include <vector>

#include "shardtrain/core/error.h"
#include "shardtrain/core/units.h"
#include "shardtrain/memory/host_capacity.h"

namespace shardtrain {

namespace {

constexpr size_t kAlignment = 64;

size_t round_up(size_t bytes) {
  return (bytes + kAlignment - 1) / kAlignment * kAlignment;
}

// Ordinary process memory, used both for the CPU device and for the host pool. On a machine with
// a GPU the CUDA backend replaces the host pool's allocator with a pinned one.
//
// Large blocks are kept for reuse, by size class, as the CUDA caching allocator keeps device
// blocks. The C library returns a block above its mmap threshold to the system when it is freed
// and maps fresh pages for the next one, zeroed by the kernel one page fault at a time: a
// training step frees and allocates the same activation sizes every step, and spent about half
// its time there (configs/tiny.yaml on one CPU thread: 5.4k tokens/s without the cache, 10.2k
// with it). The cache never makes the bytes held exceed the high-water mark of the bytes in use
// (since the last empty_cache: a new configuration's) by more than an eighth plus 16 MiB: to
// keep a freed block within that, other cached blocks go back to the system first.
class SystemAllocator : public Allocator {
 public:
  explicit SystemAllocator(Device device) : device_(device) {}
  ~SystemAllocator() override { release_cache(); }
  Device device() const override { return device_; }

  void empty_cache() override {
    std::lock_guard<std::mutex> lock(mutex_);
    release_cache();
    ledger_.set_reserved(reserved_bytes());
  }

 protected:
  void* raw_allocate(size_t bytes) override {
    const size_t size = size_class(round_up(bytes == 0 ? 1 : bytes));
    in_use_ += size;
    high_water_ = std::max(high_water_, in_use_);
    if (size >= kCachedFrom) {
      auto it = cache_.find(size);
      if (it != cache_.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        cached_ -= size;
        return p;
      }
    }
    void* p = std::aligned_alloc(kAlignment, size);
    if (p == nullptr && cached_ > 0) {  // the cache may be what stands in the way
      release_cache();
      p = std::aligned_alloc(kAlignment, size);
    }
    if (p == nullptr) in_use_ -= size;
    return p;
  }
  void raw_deallocate(void* ptr, size_t bytes) override {
    const size_t size = size_class(round_up(bytes == 0 ? 1 : bytes));
    in_use_ -= size;
    if (size < kCachedFrom) {
      std::free(ptr);
      return;
    }
    // Room is made by returning other cached blocks: the sizes freed now are those the next
    // steps ask for (after a change of configuration, the old ones are not).
    const auto limit = static_cast<size_t>(cpu_allocator_bound(static_cast<int64_t>(high_water_)));
    for (auto it = cache_.begin(); it != cache_.end() && in_use_ + cached_ + size > limit;) {
      while (!it->second.empty() && in_use_ + cached_ + size > limit) {
        std::free(it->second.back());
        it->second.pop_back();
        cached_ -= it->first;
      }
      it = it->second.empty() ? cache_.erase(it) : std::next(it);
    }
    if (in_use_ + cached_ + size > limit) {
      std::free(ptr);
      return;
    }
    cache_[size].push_back(ptr);
    cached_ += size;
  }
  int64_t reserved_bytes() const override { return static_cast<int64_t>(in_use_ + cached_); }

 private:
  static constexpr size_t kCachedFrom = size_t{128} << 10;  // the C library's default threshold

  // Blocks from 128 KiB up are rounded up to a sixteenth of their power of two (at most 6.25 %
  // more), so that sizes that differ a little share blocks.
  static size_t size_class(size_t bytes) {
    if (bytes < kCachedFrom) return bytes;
    size_t power = kCachedFrom;
    while (power <= bytes / 2) power *= 2;
    const size_t step = power / 16;
    return (bytes + step - 1) / step * step;
  }
  void release_cache() {
    for (auto& [size, blocks] : cache_)
      for (void* p : blocks) std::free(p);
    cache_.clear();
    cached_ = 0;
    high_water_ = in_use_;  // a new configuration starts here
  }

  Device device_;
  std::unordered_map<size_t, std::vector<void*>> cache_;  // free blocks by size class
  size_t cached_ = 0, in_use_ = 0;
  size_t high_water_ = 0;  // bytes in use at most, since the last empty_cache
};

struct Registry {
  SystemAllocator cpu{Device::cpu()};
  SystemAllocator host_default{Device::host()};
  Allocator* host = &host_default;
  std::array<Allocator*, 16> cuda{};
  CopyFn cuda_copy = nullptr;
  ZeroFn cuda_zero = nullptr;
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

void* Allocator::allocate(size_t bytes, MemoryCategory category) {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t counted = static_cast<int64_t>(round_up(bytes));
  // Counted only once allocated: a refused request (or a raw_allocate that throws) leaves the
  // in-use bytes and the peaks as they were.
  ledger_.check_capacity(counted, category, device().str());
  void* p = raw_allocate(bytes);
  if (p == nullptr) {
    ledger_.set_reserved(reserved_bytes());  // the cache may have been released on the way
    // Worded like MemoryLedger::charge: the request, what is in use, what to do.
    const MemoryStats& s = ledger_.stats();
    throw OutOfMemoryError(
        detail::concat("out of memory on ", device().str(), ": tried to allocate ",
                       format_bytes(counted), " for ", category_name(category), " with ",
                       format_bytes(s.total_in_use), " in use (", s.summary(), ") and ",
                       format_bytes(reserved_bytes()),
                       " reserved; the system refused it even after cached blocks were released. "
                       "Lower train.micro_batch or train.seq_len, or move further along the "
                       "scale-up recipe (shardtrain plan lists which step fits)."),
        counted);
  }
  ledger_.charge_unchecked(counted, category);
  ledger_.set_reserved(reserved_bytes());
  return p;
}

void Allocator::deallocate(void* ptr, size_t bytes, MemoryCategory category) {
  std::lock_guard<std::mutex> lock(mutex_);
  raw_deallocate(ptr, bytes);
  ledger_.release(static_cast<int64_t>(round_up(bytes)), category);
  ledger_.set_reserved(reserved_bytes());
}

void Allocator::recategorize(size_t bytes, MemoryCategory from, MemoryCategory to) {
  if (from == to) return;
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t counted = static_cast<int64_t>(round_up(bytes));
  ledger_.release(counted, from);
  ledger_.charge_unchecked(counted, to);
}

MemoryStats Allocator::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return ledger_.stats();
}

void Allocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mutex_);
  ledger_.reset_peak();
}

void Allocator::set_capacity(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  ledger_.set_capacity(bytes);
}

Allocator& allocator_for(Device device) {
  Registry& r = registry();
  switch (device.kind) {
    case DeviceKind::CPU:
      return r.cpu;
    case DeviceKind::Host:
      return *r.host;
    case DeviceKind::CUDA:
      if (device.index >= 0 && device.index < static_cast<int>(r.cuda.size()) &&
          r.cuda[device.index] != nullptr)
        return *r.cuda[device.index];
      throw Error("no allocator for " + device.str() +
                  ": this build has no CUDA backend or the device does not exist");
  }
  throw Error("unknown device");
}

void register_allocator(Device device, Allocator* allocator) {
  Registry& r = registry();
  if (device.is_host())
    r.host = allocator;
  else if (device.is_cuda())
    r.cuda.at(device.index) = allocator;
  else
    throw Error("the CPU device allocator cannot be replaced");
}

void register_cuda_copy(CopyFn fn) {
  registry().cuda_copy = fn;
}

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  if (bytes == 0) return;
  if (dst_device.cpu_addressable() && src_device.cpu_addressable()) {
    std::memcpy(dst, src, bytes);
    return;
  }
  CopyFn fn = registry().cuda_copy;
  if (fn == nullptr) throw Error("cannot copy to or from a CUDA device: no CUDA backend");
  fn(dst, dst_device, src, src_device, bytes);
}

void register_cuda_zero(ZeroFn fn) {
  registry().cuda_zero = fn;
}

void zero_bytes(void* dst, Device device, size_t bytes) {
  if (bytes == 0) return;
  if (device.cpu_addressable()) {
    std::memset(dst, 0, bytes);
    return;
  }
  ZeroFn fn = registry().cuda_zero;
  if (fn == nullptr) throw Error("cannot clear memory on a CUDA device: no CUDA backend");
  fn(dst, device, bytes);
}

DataPtr::DataPtr(size_t bytes, Device device, MemoryCategory category)
    : bytes_(bytes), device_(device), category_(category), owned_(true) {
  ptr_ = allocator_for(device).allocate(bytes, category);
}

DataPtr DataPtr::borrowed(void* ptr, size_t bytes, Device device) {
  DataPtr d;
  d.ptr_ = ptr;
  d.bytes_ = bytes;
  d.device_ = device;
  d.owned_ = false;
  return d;
}

DataPtr::~DataPtr() {
  reset();
}

DataPtr::DataPtr(DataPtr&& o) noexcept
    : ptr_(o.ptr_), bytes_(o.bytes_), device_(o.device_), category_(o.category_), owned_(o.owned_) {
  o.ptr_ = nullptr;
  o.owned_ = false;
}

DataPtr& DataPtr::operator=(DataPtr&& o) noexcept {
  if (this != &o) {
    reset();
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    device_ = o.device_;
    category_ = o.category_;
    owned_ = o.owned_;
    o.ptr_ = nullptr;
    o.owned_ = false;
  }
  return *this;
}

void DataPtr::set_category(MemoryCategory category) {
  if (owned_ && ptr_ != nullptr) allocator_for(device_).recategorize(bytes_, category_, category);
  category_ = category;
}

void DataPtr::reset() {
  if (owned_ && ptr_ != nullptr) allocator_for(device_).deallocate(ptr_, bytes_, category_);
  ptr_ = nullptr;
  owned_ = false;
}

}  // namespace shardtrain
