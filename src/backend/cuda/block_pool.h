// The block bookkeeping of the caching allocators: size classes, per-stream free lists, block
// splitting and merging. It knows nothing about CUDA; memory comes from a RawMemory (cudaMalloc
// for devices, cudaHostAlloc for the pinned host pool, plain malloc in tests).
//
// Size classes: every request is rounded up to a multiple of 512 bytes. Requests up to 1 MiB
// ("small") are carved out of 2 MiB segments; larger ones get segments rounded up to a multiple
// of 2 MiB. A free block larger than the request is split (small blocks when at least 512 bytes
// remain, large blocks when more than 1 MiB remains), and a freed block is merged with free
// neighbours of the same segment, so a segment whose blocks are all free is one block again and
// can be returned by release_cached().
//
// Every segment belongs to the stream it was first allocated for, and its blocks are handed out
// only to requests on that stream: work queued on one stream is ordered after earlier work on
// the same stream, so a block freed there may be reused at once. Use on other streams is handled
// one level up (the CUDA allocator defers the free until recorded events complete).
//
// Not thread-safe: the owning allocator locks.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <set>

namespace shardtrain::cuda::detail {

class RawMemory {
 public:
  virtual ~RawMemory() = default;
  virtual void* allocate(size_t bytes) = 0;  // nullptr when the system refuses
  virtual void release(void* ptr) = 0;
};

class BlockPool {
 public:
  static constexpr size_t kRounding = 512;
  static constexpr size_t kSmallLimit = size_t{1} << 20;  // largest "small" request
  static constexpr size_t kSegment = size_t{2} << 20;     // small segment size, large rounding

  explicit BlockPool(RawMemory& raw) : raw_(raw) {}
  ~BlockPool();
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  static size_t round_size(size_t bytes);

  // A block of at least `bytes` for use on `stream`; nullptr when no cached block fits and the
  // raw memory refuses a new segment (the caller may release_cached() and try again).
  void* allocate(size_t bytes, uintptr_t stream);
  // Returns the block that starts at `ptr` to its stream's free list. False when `ptr` is not the
  // start of a block allocated from this pool.
  bool free(void* ptr);
  // Returns every segment whose blocks are all free to the raw memory.
  void release_cached();

  // Information about the allocated block containing `ptr` (interior pointers allowed).
  struct BlockInfo {
    void* start = nullptr;
    size_t size = 0;
    uintptr_t stream = 0;
  };
  bool find(const void* ptr, BlockInfo* info) const;
  // True when `ptr` is the start of a block allocated from this pool.
  bool owns(const void* ptr) const;

  int64_t reserved_bytes() const { return reserved_; }          // held from the raw memory
  int64_t allocated_bytes() const { return allocated_bytes_; }  // in allocated blocks
  int64_t segment_count() const { return segments_; }
  int64_t cached_block_count() const {
    return static_cast<int64_t>(free_small_.size() + free_large_.size());
  }

 private:
  struct Block {
    char* ptr;
    size_t size;
    uintptr_t stream;
    bool small;
    bool allocated = false;
    Block* prev = nullptr;  // neighbours in the same segment, by address
    Block* next = nullptr;
  };
  struct ByStreamSize {
    bool operator()(const Block* a, const Block* b) const {
      if (a->stream != b->stream) return a->stream < b->stream;
      if (a->size != b->size) return a->size < b->size;
      return a->ptr < b->ptr;
    }
  };
  using FreeList = std::set<Block*, ByStreamSize>;

  FreeList& free_list(bool small) { return small ? free_small_ : free_large_; }
  void insert_free(Block* block);
  void erase_free(Block* block);

  RawMemory& raw_;
  FreeList free_small_, free_large_;
  std::map<char*, Block*> allocated_;  // by start address
  int64_t reserved_ = 0;
  int64_t allocated_bytes_ = 0;
  int64_t segments_ = 0;
};

}  // namespace shardtrain::cuda::detail
