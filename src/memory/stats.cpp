#include "shardtrain/memory/stats.h"

#include <algorithm>

#include "shardtrain/core/error.h"
#include "shardtrain/core/units.h"

namespace shardtrain {

std::string MemoryStats::summary() const {
  std::string s;
  for (int i = 0; i < kNumMemoryCategories; ++i) {
    if (i) s += ", ";
    s += std::string(category_name(static_cast<MemoryCategory>(i))) + " " + format_bytes(in_use[i]);
  }
  return s;
}

void MemoryLedger::charge(int64_t bytes, MemoryCategory c, const std::string& where) {
  check_capacity(bytes, c, where);
  charge_unchecked(bytes, c);
}

void MemoryLedger::check_capacity(int64_t bytes, MemoryCategory c, const std::string& where) const {
  if (stats_.capacity > 0 && stats_.total_in_use + bytes > stats_.capacity) {
    throw OutOfMemoryError(
        detail::concat("out of memory on ", where, ": tried to allocate ", format_bytes(bytes),
                       " for ", category_name(c), " with ", format_bytes(stats_.total_in_use),
                       " in use (", stats_.summary(), ") and a capacity of ",
                       format_bytes(stats_.capacity),
                       ". Lower train.micro_batch or train.seq_len, or move further along the "
                       "scale-up recipe (shardtrain plan lists which step fits)."),
        bytes);
  }
}

void MemoryLedger::charge_unchecked(int64_t bytes, MemoryCategory c) {
  int i = static_cast<int>(c);
  stats_.in_use[i] += bytes;
  stats_.peak[i] = std::max(stats_.peak[i], stats_.in_use[i]);
  stats_.total_in_use += bytes;
  stats_.num_allocs += 1;
  if (stats_.total_in_use > stats_.total_peak) {
    stats_.total_peak = stats_.total_in_use;
    stats_.at_peak = stats_.in_use;
  }
}

void MemoryLedger::release(int64_t bytes, MemoryCategory c) {
  stats_.in_use[static_cast<int>(c)] -= bytes;
  stats_.total_in_use -= bytes;
}

void MemoryLedger::reset_peak() {
  stats_.peak = stats_.in_use;
  stats_.at_peak = stats_.in_use;
  stats_.total_peak = stats_.total_in_use;
}

}  // namespace shardtrain
