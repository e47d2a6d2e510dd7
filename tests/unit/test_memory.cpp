// The allocator ledger: per-category counts, peaks, capacity limits and the host/CPU split.
// Statistics are process-wide, so every test measures differences from a snapshot.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "shardtrain/core/error.h"
#include "shardtrain/core/units.h"
#include "shardtrain/memory/allocator.h"
#include "shardtrain/tensor/tensor.h"

namespace shardtrain {
namespace {

constexpr auto kParams = MemoryCategory::Parameters;
constexpr auto kGrads = MemoryCategory::Gradients;
constexpr auto kActs = MemoryCategory::Activations;
constexpr auto kOffloaded = MemoryCategory::Offloaded;

// Restores an allocator's capacity to "unlimited" however the test ends.
class CapacityGuard {
 public:
  explicit CapacityGuard(Allocator& a) : a_(a) {}
  ~CapacityGuard() { a_.set_capacity(0); }

 private:
  Allocator& a_;
};

Tensor alloc(int64_t elements, DType dtype, MemoryCategory category,
             Device device = Device::cpu()) {
  CategoryScope scope(category);
  return empty({elements}, dtype, device);
}

TEST(Memory, CountsBytesPerCategoryRoundedToAlignment) {
  Allocator& cpu = allocator_for(Device::cpu());
  const MemoryStats before = cpu.stats();
  {
    Tensor p = alloc(1000, DType::F32, kParams);  // 4000 bytes -> 4032 counted
    Tensor g = alloc(100, DType::BF16, kGrads);   // 200 bytes -> 256 counted
    Tensor a = alloc(16, DType::F32, kActs);      // 64 bytes exactly
    const MemoryStats s = cpu.stats();
    EXPECT_EQ(s.in_use_of(kParams) - before.in_use_of(kParams), 4032);
    EXPECT_EQ(s.in_use_of(kGrads) - before.in_use_of(kGrads), 256);
    EXPECT_EQ(s.in_use_of(kActs) - before.in_use_of(kActs), 64);
    EXPECT_EQ(s.total_in_use - before.total_in_use, 4032 + 256 + 64);
    EXPECT_EQ(s.num_allocs - before.num_allocs, 3);
    EXPECT_EQ(p.category(), kParams);
    EXPECT_EQ(g.category(), kGrads);
  }
  const MemoryStats after = cpu.stats();
  EXPECT_EQ(after.in_use, before.in_use);
  EXPECT_EQ(after.total_in_use, before.total_in_use);
}

TEST(Memory, ScopesNestAndRestore) {
  EXPECT_EQ(CategoryScope::current(), kActs);
  {
    CategoryScope outer(kParams);
    EXPECT_EQ(CategoryScope::current(), kParams);
    {
      CategoryScope inner(MemoryCategory::Workspace);
      EXPECT_EQ(CategoryScope::current(), MemoryCategory::Workspace);
    }
    EXPECT_EQ(CategoryScope::current(), kParams);
  }
  EXPECT_EQ(CategoryScope::current(), kActs);
}

TEST(Memory, PeaksAndTheSnapshotAtThePeak) {
  Allocator& cpu = allocator_for(Device::cpu());
  cpu.reset_peak();
  const MemoryStats base = cpu.stats();
  EXPECT_EQ(base.total_peak, base.total_in_use);
  EXPECT_EQ(base.peak, base.in_use);

  Tensor p = alloc(1024, DType::F32, kParams);  // 4096
  {
    Tensor a = alloc(2048, DType::F32, kActs);  // 8192: total peaks here
  }
  Tensor g = alloc(256, DType::F32, kGrads);  // 1024, below the earlier total

  const MemoryStats s = cpu.stats();
  EXPECT_EQ(s.total_peak - base.total_in_use, 4096 + 8192);
  EXPECT_EQ(s.peak_of(kActs) - base.in_use_of(kActs), 8192);
  EXPECT_EQ(s.peak_of(kGrads) - base.in_use_of(kGrads), 1024);
  // at_peak is the breakdown when the total peaked: parameters and activations, no gradients.
  EXPECT_EQ(s.at_peak[static_cast<int>(kParams)] - base.in_use_of(kParams), 4096);
  EXPECT_EQ(s.at_peak[static_cast<int>(kActs)] - base.in_use_of(kActs), 8192);
  EXPECT_EQ(s.at_peak[static_cast<int>(kGrads)] - base.in_use_of(kGrads), 0);
  EXPECT_EQ(s.in_use_of(kActs), base.in_use_of(kActs));

  cpu.reset_peak();
  const MemoryStats r = cpu.stats();
  EXPECT_EQ(r.total_peak, r.total_in_use);
  EXPECT_EQ(r.peak, r.in_use);
  EXPECT_EQ(r.at_peak, r.in_use);
  EXPECT_EQ(r.total_in_use - base.total_in_use, 4096 + 1024);
}

TEST(Memory, CapacityRaisesOutOfMemoryWithAnActionableMessage) {
  Allocator& cpu = allocator_for(Device::cpu());
  CapacityGuard guard(cpu);
  Tensor held = alloc(4096, DType::F32, kParams);  // 16 KiB of parameters in the breakdown
  const int64_t capacity = cpu.stats().total_in_use + 10000;
  cpu.set_capacity(capacity);
  const MemoryStats before = cpu.stats();
  EXPECT_EQ(before.capacity, capacity);

  const int64_t requested = 20032;  // 20000 bytes rounded to the 64-byte alignment
  try {
    Tensor big = alloc(5000, DType::F32, kActs);
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    EXPECT_EQ(e.requested_bytes(), requested);
    const std::string msg = e.what();
    EXPECT_NE(msg.find(format_bytes(requested)), std::string::npos) << msg;
    EXPECT_NE(msg.find(format_bytes(capacity)), std::string::npos) << msg;
    EXPECT_NE(msg.find("activations"), std::string::npos) << msg;
    EXPECT_NE(msg.find("parameters " + format_bytes(before.in_use_of(kParams))), std::string::npos)
        << msg;
    EXPECT_NE(msg.find("cpu"), std::string::npos) << msg;
  }

  // A failed request changes nothing, and the allocator keeps working.
  const MemoryStats after = cpu.stats();
  EXPECT_EQ(after.in_use, before.in_use);
  EXPECT_EQ(after.total_in_use, before.total_in_use);
  EXPECT_EQ(after.total_peak, before.total_peak);
  EXPECT_EQ(after.num_allocs, before.num_allocs);
  {
    Tensor small = alloc(2000, DType::F32, kActs);  // 8000 bytes fit under the cap
    EXPECT_EQ(cpu.stats().in_use_of(kActs) - before.in_use_of(kActs), 8000);
  }
  cpu.set_capacity(0);
  Tensor now_fits = alloc(5000, DType::F32, kActs);
  EXPECT_EQ(cpu.stats().in_use_of(kActs) - before.in_use_of(kActs), requested);
}

// An allocator whose system refuses (returns nullptr) or fails (throws) on demand, as a GPU's
// does when its memory is full or its driver reports an error.
class FlakyAllocator final : public Allocator {
 public:
  enum class Mode { Serve, Refuse, Throw };
  Mode mode = Mode::Serve;
  Device device() const override { return Device::cpu(); }

 protected:
  void* raw_allocate(size_t bytes) override {
    if (mode == Mode::Refuse) return nullptr;
    if (mode == Mode::Throw) throw Error("the system failed");
    return ::operator new(bytes);
  }
  void raw_deallocate(void* ptr, size_t) override { ::operator delete(ptr); }
};

TEST(Memory, ARefusedOrFailedAllocationIsNeverCounted) {
  FlakyAllocator a;
  void* kept = a.allocate(1000, kParams);
  const MemoryStats before = a.stats();
  a.mode = FlakyAllocator::Mode::Refuse;
  EXPECT_THROW(a.allocate(1 << 20, kActs), OutOfMemoryError);
  a.mode = FlakyAllocator::Mode::Throw;
  EXPECT_THROW(a.allocate(1 << 20, kActs), Error);
  const MemoryStats after = a.stats();
  // Neither the bytes in use nor the peaks saw the megabyte that was never allocated.
  EXPECT_EQ(after.total_in_use, before.total_in_use);
  EXPECT_EQ(after.total_peak, before.total_peak);
  EXPECT_EQ(after.peak, before.peak);
  EXPECT_EQ(after.num_allocs, before.num_allocs);
  a.mode = FlakyAllocator::Mode::Serve;
  a.deallocate(kept, 1000, kParams);
  EXPECT_EQ(a.stats().total_in_use, 0);
}

TEST(Memory, HostPoolIsSeparateFromTheCpuDevice) {
  Allocator& cpu = allocator_for(Device::cpu());
  Allocator& host = allocator_for(Device::host());
  ASSERT_NE(&cpu, &host);
  const MemoryStats cpu0 = cpu.stats();
  const MemoryStats host0 = host.stats();

  Tensor t = alloc(1024, DType::F32, kActs);
  t.data<float>()[7] = 3.5f;
  EXPECT_EQ(cpu.stats().in_use_of(kActs) - cpu0.in_use_of(kActs), 4096);

  Tensor h = t.to(Device::host(), kOffloaded);
  EXPECT_TRUE(h.device().is_host());
  EXPECT_EQ(h.category(), kOffloaded);
  EXPECT_EQ(h.data<float>()[7], 3.5f);
  EXPECT_NE(h.data_ptr(), t.data_ptr());
  EXPECT_EQ(host.stats().in_use_of(kOffloaded) - host0.in_use_of(kOffloaded), 4096);
  EXPECT_EQ(host.stats().total_in_use - host0.total_in_use, 4096);
  EXPECT_EQ(cpu.stats().in_use_of(kOffloaded), cpu0.in_use_of(kOffloaded));

  t = Tensor();  // drop the device copy: device bytes fall, the host copy stays
  EXPECT_EQ(cpu.stats().total_in_use, cpu0.total_in_use);
  EXPECT_EQ(host.stats().total_in_use - host0.total_in_use, 4096);

  Tensor back = h.to(Device::cpu(), kActs);
  EXPECT_EQ(back.data<float>()[7], 3.5f);
  EXPECT_EQ(cpu.stats().in_use_of(kActs) - cpu0.in_use_of(kActs), 4096);
  h = Tensor();
  EXPECT_EQ(host.stats().total_in_use, host0.total_in_use);
}

TEST(Memory, HostCapacityIsIndependentOfTheDevice) {
  Allocator& cpu = allocator_for(Device::cpu());
  Allocator& host = allocator_for(Device::host());
  CapacityGuard cpu_guard(cpu);
  CapacityGuard host_guard(host);
  host.set_capacity(host.stats().total_in_use + 1024);
  EXPECT_THROW(alloc(1024, DType::F32, kOffloaded, Device::host()), OutOfMemoryError);
  Tensor on_device = alloc(1024, DType::F32, kActs);  // the CPU device has no cap
  EXPECT_EQ(on_device.numel(), 1024);
}

TEST(Memory, BorrowedMemoryIsNeverCounted) {
  Allocator& cpu = allocator_for(Device::cpu());
  const MemoryStats before = cpu.stats();
  std::vector<float> buffer(256, 1.0f);
  {
    DataPtr d = DataPtr::borrowed(buffer.data(), buffer.size() * 4, Device::cpu());
    EXPECT_EQ(d.get(), buffer.data());
    EXPECT_EQ(cpu.stats().total_in_use, before.total_in_use);
  }
  EXPECT_EQ(cpu.stats().total_in_use, before.total_in_use);
  EXPECT_EQ(buffer[255], 1.0f);
}

}  // namespace
}  // namespace shardtrain

namespace shardtrain {
namespace {

// The CPU device keeps freed blocks of 128 KiB and more for the next request of their size
// class, counted as reserved, never in use; it holds at most an eighth (plus 16 MiB) over the
// in-use high-water mark, making room by returning other cached blocks; empty_cache returns them.
TEST(Memory, TheCpuDeviceReusesLargeBlocksWithinItsBound) {
  Allocator& cpu = allocator_for(Device::cpu());
  cpu.empty_cache();
  const MemoryStats start = cpu.stats();
  EXPECT_EQ(start.reserved, start.total_in_use) << "nothing cached after empty_cache";
  const int64_t big = int64_t{1} << 20;  // 4 MiB of fp32
  void* first = nullptr;
  {
    Tensor t = alloc(big, DType::F32, kActs);
    first = t.data_ptr();
  }
  EXPECT_EQ(cpu.stats().total_in_use, start.total_in_use);
  EXPECT_GE(cpu.stats().reserved, start.reserved + 4 * big) << "the freed block stays cached";
  {
    // A request of a little less falls in the same size class and gets the same block.
    Tensor t = alloc(big - 1000, DType::F32, kActs);
    EXPECT_EQ(t.data_ptr(), first);
  }
  // Small blocks are left to the C library.
  { Tensor small = alloc(1000, DType::F32, kActs); }
  EXPECT_LT(cpu.stats().reserved - cpu.stats().total_in_use, 4 * big + 64 * 1024);

  // 40 blocks of growing sizes (256 KiB to 11 MiB, 124 MiB in all), one at a time: what stays
  // cached is bounded by the peak in use since empty_cache.
  cpu.empty_cache();
  cpu.reset_peak();
  double elements = 65536;
  for (int i = 1; i <= 40; ++i, elements *= 1.1)
    Tensor t = alloc(static_cast<int64_t>(elements), DType::F32, kActs);
  const MemoryStats s = cpu.stats();
  EXPECT_LT(s.total_peak, start.total_in_use + (int64_t{12} << 20));
  EXPECT_LE(s.reserved, s.total_peak + s.total_peak / 8 + (int64_t{16} << 20) + 64 * 1024)
      << s.reserved - s.total_in_use << " bytes kept";
  EXPECT_GE(s.reserved - s.total_in_use, 4 * big) << "the last block freed stays cached";
  cpu.empty_cache();
  EXPECT_EQ(cpu.stats().reserved, cpu.stats().total_in_use);
}

}  // namespace
}  // namespace shardtrain
