#include "block_pool.h"

#include <iterator>

namespace shardtrain::cuda::detail {

BlockPool::~BlockPool() {
  // Blocks still allocated belong to live tensors (possible only at process exit); their
  // segments are left to the process teardown.
  release_cached();
}

size_t BlockPool::round_size(size_t bytes) {
  if (bytes < kRounding) return kRounding;
  return (bytes + kRounding - 1) / kRounding * kRounding;
}

void BlockPool::insert_free(Block* block) {
  free_list(block->small).insert(block);
}
void BlockPool::erase_free(Block* block) {
  free_list(block->small).erase(block);
}

void* BlockPool::allocate(size_t bytes, uintptr_t stream) {
  const size_t size = round_size(bytes);
  const bool small = size <= kSmallLimit;
  FreeList& list = free_list(small);

  // Best fit: the smallest cached block of this stream that is large enough.
  Block key{nullptr, size, stream, small};
  Block* block = nullptr;
  auto it = list.lower_bound(&key);
  if (it != list.end() && (*it)->stream == stream) {
    block = *it;
    list.erase(it);
  } else {
    const size_t segment = small ? kSegment : (size + kSegment - 1) / kSegment * kSegment;
    void* mem = raw_.allocate(segment);
    if (mem == nullptr) return nullptr;
    block = new Block{static_cast<char*>(mem), segment, stream, small};
    reserved_ += static_cast<int64_t>(segment);
    segments_ += 1;
  }

  const size_t remaining = block->size - size;
  const bool split = small ? remaining >= kRounding : remaining > kSmallLimit;
  if (split) {
    Block* rest = new Block{block->ptr + size, remaining, stream, small};
    rest->prev = block;
    rest->next = block->next;
    if (block->next != nullptr) block->next->prev = rest;
    block->next = rest;
    block->size = size;
    insert_free(rest);
  }
  block->allocated = true;
  allocated_[block->ptr] = block;
  allocated_bytes_ += static_cast<int64_t>(block->size);
  return block->ptr;
}

bool BlockPool::free(void* ptr) {
  auto it = allocated_.find(static_cast<char*>(ptr));
  if (it == allocated_.end()) return false;
  Block* block = it->second;
  allocated_.erase(it);
  block->allocated = false;
  allocated_bytes_ -= static_cast<int64_t>(block->size);

  // Merge with free neighbours so that a fully free segment becomes one block again.
  if (Block* prev = block->prev; prev != nullptr && !prev->allocated) {
    erase_free(prev);
    prev->size += block->size;
    prev->next = block->next;
    if (block->next != nullptr) block->next->prev = prev;
    delete block;
    block = prev;
  }
  if (Block* next = block->next; next != nullptr && !next->allocated) {
    erase_free(next);
    block->size += next->size;
    block->next = next->next;
    if (next->next != nullptr) next->next->prev = block;
    delete next;
  }
  insert_free(block);
  return true;
}

void BlockPool::release_cached() {
  for (FreeList* list : {&free_small_, &free_large_}) {
    for (auto it = list->begin(); it != list->end();) {
      Block* block = *it;
      if (block->prev == nullptr && block->next == nullptr) {
        raw_.release(block->ptr);
        reserved_ -= static_cast<int64_t>(block->size);
        segments_ -= 1;
        delete block;
        it = list->erase(it);
      } else {
        ++it;
      }
    }
  }
}

bool BlockPool::find(const void* ptr, BlockInfo* info) const {
  char* p = static_cast<char*>(const_cast<void*>(ptr));
  auto it = allocated_.upper_bound(p);
  if (it == allocated_.begin()) return false;
  const Block* block = std::prev(it)->second;
  if (p >= block->ptr + block->size) return false;
  *info = {block->ptr, block->size, block->stream};
  return true;
}

bool BlockPool::owns(const void* ptr) const {
  return allocated_.count(static_cast<char*>(const_cast<void*>(ptr))) != 0;
}

}  // namespace shardtrain::cuda::detail
