// The CUDA caching allocator (statistics, caching per stream, deferred reuse across streams,
// empty_cache, out-of-memory errors) and the pinned host pool.
#include <gtest/gtest.h>

#include "cuda_test_util.h"
#include "shardtrain/core/units.h"
#include "shardtrain/memory/allocator.h"
#ifdef SHARDTRAIN_HAVE_CUDA
#include <cuda_runtime.h>

#include <atomic>
#include <thread>
#endif

namespace shardtrain {
namespace {

using testing::cuda0;

constexpr int64_t kMiB = int64_t{1} << 20;

#ifdef SHARDTRAIN_HAVE_CUDA

TEST(CudaAllocator, CountsBytesAndCachesFreedBlocks) {
  REQUIRE_CUDA();
  Allocator& alloc = allocator_for(cuda0());
  alloc.empty_cache();
  const MemoryStats before = alloc.stats();
  void* first = nullptr;
  {
    CategoryScope scope(MemoryCategory::Gradients);
    Tensor t = empty({1000}, DType::BF16, cuda0());  // 2000 bytes, counted as 2048
    first = t.data_ptr();
    const MemoryStats during = alloc.stats();
    EXPECT_EQ(
        during.in_use_of(MemoryCategory::Gradients) - before.in_use_of(MemoryCategory::Gradients),
        2048);
    EXPECT_EQ(during.total_in_use - before.total_in_use, 2048);
    // A small request takes a 2 MiB segment from the driver.
    EXPECT_EQ(during.reserved - before.reserved, 2 * kMiB);
    EXPECT_GE(during.total_peak, during.total_in_use);
  }
  const MemoryStats after = alloc.stats();
  EXPECT_EQ(after.total_in_use, before.total_in_use);
  EXPECT_EQ(after.reserved - before.reserved, 2 * kMiB) << "freed blocks stay cached";
  {
    Tensor again = empty({1000}, DType::BF16, cuda0());
    EXPECT_EQ(again.data_ptr(), first) << "a freed block is reused on the same stream";
  }
  alloc.empty_cache();
  EXPECT_EQ(alloc.stats().reserved, before.reserved);
}

TEST(CudaAllocator, LargeBlocksRoundToTwoMiBAndSplit) {
  REQUIRE_CUDA();
  Allocator& alloc = allocator_for(cuda0());
  alloc.empty_cache();
  const int64_t base = alloc.stats().reserved;
  {
    Tensor big = empty({5 * kMiB + 1}, DType::U8, cuda0());
    EXPECT_EQ(alloc.stats().reserved - base, 6 * kMiB);
  }
  {
    // A 3 MiB request is carved out of the cached 6 MiB segment (no new driver memory).
    Tensor part = empty({3 * kMiB}, DType::U8, cuda0());
    EXPECT_EQ(alloc.stats().reserved - base, 6 * kMiB);
    Tensor rest = empty({3 * kMiB}, DType::U8, cuda0());
    EXPECT_EQ(alloc.stats().reserved - base, 6 * kMiB);
    EXPECT_EQ(static_cast<char*>(rest.data_ptr()) - static_cast<char*>(part.data_ptr()), 3 * kMiB);
  }
  alloc.empty_cache();  // the two halves merged back into one free segment
  EXPECT_EQ(alloc.stats().reserved, base);
}

TEST(CudaAllocator, BlocksAreReusedOnlyOnTheirStream) {
  REQUIRE_CUDA();
  Allocator& alloc = allocator_for(cuda0());
  cuda::Stream side(0);
  void* on_side = nullptr;
  {
    cuda::StreamGuard guard(side.view());
    Tensor t = empty({4096}, DType::F32, cuda0());
    on_side = t.data_ptr();
  }
  Tensor t = empty({4096}, DType::F32, cuda0());  // default stream: must not get the side block
  EXPECT_NE(t.data_ptr(), on_side);
  {
    cuda::StreamGuard guard(side.view());
    Tensor again = empty({4096}, DType::F32, cuda0());
    EXPECT_EQ(again.data_ptr(), on_side);
  }
  alloc.empty_cache();
}

// Holds back every later piece of work on a stream until release() (or destruction), so that a
// test decides when the stream's work finishes instead of racing a kernel's run time. While it is
// closed the test must not call anything that may synchronise the context (cudaMalloc, the first
// launch of a kernel under lazy module loading): that would wait for the gate and never return.
class StreamGate {
 public:
  explicit StreamGate(cudaStream_t stream) : stream_(stream) {
    EXPECT_EQ(cudaLaunchHostFunc(stream_, &StreamGate::wait, &open_), cudaSuccess);
  }
  ~StreamGate() {
    release();
    (void)cudaStreamSynchronize(stream_);  // the callback no longer reads open_
  }
  StreamGate(const StreamGate&) = delete;
  StreamGate& operator=(const StreamGate&) = delete;
  void release() { open_.store(true); }

 private:
  static void CUDART_CB wait(void* open) {
    while (!static_cast<std::atomic<bool>*>(open)->load()) std::this_thread::yield();
  }
  cudaStream_t stream_;
  std::atomic<bool> open_{false};
};

TEST(CudaAllocator, RecordStreamDefersReuse) {
  REQUIRE_CUDA();
  allocator_for(cuda0()).empty_cache();
  cuda::Stream side(0);
  // Two 4 MiB segments (one whole large block each) from the driver before the gate closes: one
  // for the tensor used on the side stream, one cached for the request made while it is busy.
  Tensor t = empty({kMiB}, DType::F32, cuda0());
  void* const ptr = t.data_ptr();
  empty({kMiB}, DType::F32, cuda0());
  backend_for(cuda0()).fill(t, 0.0f);  // loads the fill kernel now, not under the gate
  {
    StreamGate gate(static_cast<cudaStream_t>(side.handle()));
    {
      cuda::StreamGuard guard(side.view());
      backend_for(cuda0()).fill(t, 1.0f);  // queued behind the gate
    }
    cuda::record_stream(t.data_ptr(), side.view());
    t = Tensor();
    // The side stream's use has not finished, so the block is not handed out again yet.
    Tensor while_busy = empty({kMiB}, DType::F32, cuda0());
    EXPECT_NE(while_busy.data_ptr(), ptr);
    gate.release();
    side.synchronize();
    Tensor after = empty({kMiB}, DType::F32, cuda0());
    EXPECT_EQ(after.data_ptr(), ptr) << "reused once the side stream's work has finished";
  }
  EXPECT_THROW(cuda::record_stream(reinterpret_cast<void*>(16), side.view()), Error);
}

// The driver may give a destroyed stream's handle to the next stream created, so nothing may
// stay keyed by it: the cuBLASLt workspace made for the stream is freed with it, and a free that
// was to wait for the stream's use no longer records an event on a dead handle.
TEST(CudaAllocator, ADestroyedStreamLeavesNoWorkspaceOrPendingFreeBehind) {
  REQUIRE_CUDA();
  Allocator& alloc = allocator_for(cuda0());
  Backend& gpu = backend_for(cuda0());
  alloc.empty_cache();
  const int64_t workspace_before = alloc.stats().in_use_of(MemoryCategory::Workspace);
  Tensor t = empty({kMiB}, DType::F32, cuda0());
  void* const ptr = t.data_ptr();
  {
    cuda::Stream side(0);
    {
      cuda::StreamGuard guard(side.view());
      Tensor a = ones({64, 64}, DType::F32, cuda0()), c = empty({64, 64}, DType::F32, cuda0());
      GemmArgs g;
      g.m = g.n = g.k = 64;
      gpu.gemm(g, a, a, c);  // the side stream's first product: a workspace of its own
      gpu.fill(t, 1.0f);
    }
    cuda::record_stream(t.data_ptr(), side.view());
    EXPECT_GT(alloc.stats().in_use_of(MemoryCategory::Workspace), workspace_before);
  }
  EXPECT_EQ(alloc.stats().in_use_of(MemoryCategory::Workspace), workspace_before)
      << "the destroyed stream's cuBLASLt workspace is still held";
  t = Tensor();  // its free no longer waits for the destroyed stream
  Tensor again = empty({kMiB}, DType::F32, cuda0());
  EXPECT_EQ(again.data_ptr(), ptr);
}

TEST(CudaAllocator, CapacityGivesOutOfMemoryWithTheLedgerMessage) {
  REQUIRE_CUDA();
  Allocator& alloc = allocator_for(cuda0());
  const int64_t in_use = alloc.stats().total_in_use;
  alloc.set_capacity(in_use + 4 * kMiB);
  Tensor fits = empty({kMiB}, DType::F32, cuda0());
  try {
    Tensor too_big = empty({kMiB}, DType::F32, cuda0());
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("out of memory on cuda:0: tried to allocate 4.00 MiB for activations"),
              std::string::npos)
        << msg;
    EXPECT_EQ(e.requested_bytes(), 4 * kMiB);
  }
  alloc.set_capacity(0);
  EXPECT_EQ(alloc.stats().total_in_use, in_use + 4 * kMiB);
}

TEST(CudaAllocator, DriverRefusalIsOutOfMemory) {
  REQUIRE_CUDA();
  Allocator& alloc = allocator_for(cuda0());
  const int64_t in_use = alloc.stats().total_in_use;
  // Far beyond any GPU: cudaMalloc fails even after the cache is released.
  try {
    Tensor huge = empty({int64_t{1} << 50}, DType::U8, cuda0());
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("out of memory on cuda:0: tried to allocate 1024.00 TiB for activations"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("refused"), std::string::npos) << msg;
  }
  EXPECT_EQ(alloc.stats().total_in_use, in_use) << "a refused request is not counted";
  Tensor ok = empty({16}, DType::F32, cuda0());  // the allocator still works afterwards
  backend_for(cuda0()).fill(ok, 2.0f);
  EXPECT_EQ(ok.to_float_vector()[15], 2.0f);
}

TEST(CudaAllocator, HostPoolIsPinnedAndCopiesRoundTrip) {
  REQUIRE_CUDA();
  Tensor host = from_floats({1, 2, 3, 4, 5}, {5}, DType::F32, Device::host());
  cudaPointerAttributes attr{};
  ASSERT_EQ(cudaPointerGetAttributes(&attr, host.data_ptr()), cudaSuccess);
  EXPECT_EQ(attr.type, cudaMemoryTypeHost) << "host-pool tensors live in page-locked memory";
  Tensor dev = host.to(cuda0());
  Tensor back = dev.to(Device::host(), MemoryCategory::Offloaded);
  EXPECT_EQ(back.to_float_vector(), (std::vector<float>{1, 2, 3, 4, 5}));
  EXPECT_GE(allocator_for(Device::host()).stats().in_use_of(MemoryCategory::Offloaded), 64);
  // CPU-device memory is ordinary pageable memory and copies just as well.
  Tensor cpu_copy = dev.to(Device::cpu());
  EXPECT_EQ(cpu_copy.to_float_vector(), host.to_float_vector());
  // Device to device, and a dtype conversion on the device.
  Tensor dev2 = dev.clone();
  EXPECT_EQ(dev2.to(DType::BF16).to_float_vector(), host.to_float_vector());
}

#else

TEST(CudaAllocator, NeedsCudaBuild) {
  REQUIRE_CUDA();
}

#endif

}  // namespace
}  // namespace shardtrain
