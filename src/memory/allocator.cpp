#include "shardtrain/memory/allocator.h"

#include <array>
#include <cstdlib>
#include <cstring>

#include "shardtrain/core/error.h"
#include "shardtrain/core/units.h"

namespace shardtrain {

namespace {

constexpr size_t kAlignment = 64;

size_t round_up(size_t bytes) {
  return (bytes + kAlignment - 1) / kAlignment * kAlignment;
}

// Ordinary process memory, used both for the CPU device and for the host pool. On a machine with
// a GPU the CUDA backend replaces the host pool's allocator with a pinned one.
class SystemAllocator : public Allocator {
 public:
  explicit SystemAllocator(Device device) : device_(device) {}
  Device device() const override { return device_; }

 protected:
  void* raw_allocate(size_t bytes) override {
    return std::aligned_alloc(kAlignment, round_up(bytes == 0 ? 1 : bytes));
  }
  void raw_deallocate(void* ptr, size_t) override { std::free(ptr); }

 private:
  Device device_;
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
