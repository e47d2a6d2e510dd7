// The caching allocators' block bookkeeping (size classes, per-stream free lists, splitting and
// merging, release of free segments), on plain host memory: it needs no GPU.
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>

#include "cuda_test_util.h"
#ifdef SHARDTRAIN_HAVE_CUDA
#include "backend/cuda/block_pool.h"
#endif

namespace shardtrain {
namespace {

#ifdef SHARDTRAIN_HAVE_CUDA

using cuda::detail::BlockPool;
using cuda::detail::RawMemory;

constexpr size_t kMiB = size_t{1} << 20;

// Host memory with a cap, recording what is outstanding.
class FakeMemory : public RawMemory {
 public:
  explicit FakeMemory(size_t cap) : cap_(cap) {}
  void* allocate(size_t bytes) override {
    if (held_ + bytes > cap_) return nullptr;
    void* p = std::aligned_alloc(512, bytes);
    held_ += bytes;
    sizes_[p] = bytes;
    ++calls_;
    return p;
  }
  void release(void* ptr) override {
    held_ -= sizes_.at(ptr);
    sizes_.erase(ptr);
    std::free(ptr);
  }
  size_t held() const { return held_; }
  int calls() const { return calls_; }

 private:
  size_t cap_;
  size_t held_ = 0;
  int calls_ = 0;
  std::map<void*, size_t> sizes_;
};

TEST(CudaBlockPool, RoundsSizes) {
  EXPECT_EQ(BlockPool::round_size(0), 512u);
  EXPECT_EQ(BlockPool::round_size(1), 512u);
  EXPECT_EQ(BlockPool::round_size(512), 512u);
  EXPECT_EQ(BlockPool::round_size(513), 1024u);
}

TEST(CudaBlockPool, SmallBlocksShareASegmentAndMergeBack) {
  FakeMemory raw(64 * kMiB);
  {
    BlockPool pool(raw);
    char* a = static_cast<char*>(pool.allocate(100, 1));
    char* b = static_cast<char*>(pool.allocate(1000, 1));
    char* c = static_cast<char*>(pool.allocate(512, 1));
    EXPECT_EQ(raw.calls(), 1) << "all three come from one 2 MiB segment";
    EXPECT_EQ(pool.reserved_bytes(), static_cast<int64_t>(2 * kMiB));
    EXPECT_EQ(b - a, 512);
    EXPECT_EQ(c - b, 1024);
    EXPECT_EQ(pool.allocated_bytes(), 512 + 1024 + 512);

    BlockPool::BlockInfo info;
    ASSERT_TRUE(pool.find(b + 700, &info));
    EXPECT_EQ(info.start, b);
    EXPECT_EQ(info.size, 1024u);
    EXPECT_EQ(info.stream, 1u);

    EXPECT_TRUE(pool.free(b));
    EXPECT_FALSE(pool.free(b)) << "double free is refused";
    // The hole is reused by a request that fits (best fit).
    EXPECT_EQ(pool.allocate(600, 1), b);
    pool.free(b);
    pool.free(a);
    pool.free(c);
    EXPECT_EQ(pool.allocated_bytes(), 0);
    EXPECT_EQ(pool.cached_block_count(), 1) << "neighbours merged into one segment-sized block";
    pool.release_cached();
    EXPECT_EQ(pool.reserved_bytes(), 0);
    EXPECT_EQ(raw.held(), 0u);
  }
}

TEST(CudaBlockPool, StreamsDoNotShareBlocks) {
  FakeMemory raw(64 * kMiB);
  BlockPool pool(raw);
  void* s1 = pool.allocate(4096, 1);
  pool.free(s1);
  void* s2 = pool.allocate(4096, 2);
  EXPECT_NE(s1, s2);
  EXPECT_EQ(raw.calls(), 2);
  EXPECT_EQ(pool.allocate(4096, 1), s1);
}

TEST(CudaBlockPool, LargeBlocksSplitOnlyWithMoreThanOneMiBLeft) {
  FakeMemory raw(64 * kMiB);
  BlockPool pool(raw);
  char* big = static_cast<char*>(pool.allocate(5 * kMiB + 1, 0));  // segment of 6 MiB
  EXPECT_EQ(pool.reserved_bytes(), static_cast<int64_t>(6 * kMiB));
  pool.free(big);
  char* part = static_cast<char*>(pool.allocate(3 * kMiB, 0));
  EXPECT_EQ(part, big);
  char* rest = static_cast<char*>(pool.allocate(2 * kMiB, 0));
  EXPECT_EQ(rest, big + 3 * kMiB) << "the 3 MiB remainder was split off";
  pool.free(rest);
  pool.free(part);
  // 5.5 MiB from the merged 6 MiB block would leave 0.5 MiB: not split.
  char* whole = static_cast<char*>(pool.allocate(5 * kMiB + kMiB / 2, 0));
  EXPECT_EQ(pool.allocated_bytes(), static_cast<int64_t>(6 * kMiB));
  pool.free(whole);
  EXPECT_EQ(raw.calls(), 1);
}

TEST(CudaBlockPool, RefusalIsReportedAndCacheCanBeReleased) {
  FakeMemory raw(8 * kMiB);
  BlockPool pool(raw);
  void* a = pool.allocate(6 * kMiB, 0);
  ASSERT_NE(a, nullptr);
  pool.free(a);
  // 4 MiB on another stream does not fit next to the cached 6 MiB segment...
  EXPECT_EQ(pool.allocate(4 * kMiB, 7), nullptr);
  // ...until the cache is returned.
  pool.release_cached();
  EXPECT_NE(pool.allocate(4 * kMiB, 7), nullptr);
}

#else

TEST(CudaBlockPool, NeedsCudaBuild) {
  REQUIRE_CUDA();
}

#endif

}  // namespace
}  // namespace shardtrain
