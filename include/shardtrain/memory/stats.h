// Memory statistics of one device or of the host pool.
#pragma once
#include <array>
#include <cstdint>
#include <string>

#include "shardtrain/memory/category.h"

namespace shardtrain {

struct MemoryStats {
  std::array<int64_t, kNumMemoryCategories> in_use{};   // bytes allocated now, per category
  std::array<int64_t, kNumMemoryCategories> peak{};     // max of in_use, per category, since reset
  std::array<int64_t, kNumMemoryCategories> at_peak{};  // in_use per category when total peaked
  int64_t total_in_use = 0;
  int64_t total_peak = 0;
  int64_t reserved = 0;  // bytes held from the system (caching allocators keep freed blocks)
  int64_t capacity = 0;  // 0 = unlimited
  int64_t num_allocs = 0;

  int64_t in_use_of(MemoryCategory c) const { return in_use[static_cast<int>(c)]; }
  int64_t peak_of(MemoryCategory c) const { return peak[static_cast<int>(c)]; }
  // One line per category, for error messages and logs.
  std::string summary() const;
};

// Counts bytes per category and enforces an optional capacity. Shared by every allocator so that
// CPU and CUDA devices report identical figures. Not thread-safe by itself; allocators lock.
class MemoryLedger {
 public:
  // Throws OutOfMemoryError (naming `where`, the request and the in-use breakdown) when the
  // capacity would be exceeded.
  void charge(int64_t bytes, MemoryCategory c, const std::string& where);
  // charge's capacity check alone (OutOfMemoryError naming `where` when `bytes` more would not
  // fit), for callers that count the bytes only once they are really allocated.
  void check_capacity(int64_t bytes, MemoryCategory c, const std::string& where) const;
  // Counts bytes without the capacity check (bytes that are already allocated).
  void charge_unchecked(int64_t bytes, MemoryCategory c);
  void release(int64_t bytes, MemoryCategory c);
  void reset_peak();
  void set_capacity(int64_t bytes) { stats_.capacity = bytes; }
  void set_reserved(int64_t bytes) { stats_.reserved = bytes; }
  const MemoryStats& stats() const { return stats_; }

 private:
  MemoryStats stats_;
};

}  // namespace shardtrain
