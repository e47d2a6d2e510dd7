#include "shardtrain/memory/host_capacity.h"

#include <unistd.h>

#include <charconv>
#include <fstream>
#include <string>

namespace shardtrain {

namespace {

// A cgroup limit file's number; 0 for "max", a missing file or anything unreadable.
int64_t read_limit(const std::string& path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text)) return 0;
  int64_t value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  return ec == std::errc() && end == text.data() + text.size() && value > 0 ? value : 0;
}

}  // namespace

HostCapacity host_memory_capacity() {
  HostCapacity out;
  const long pages = ::sysconf(_SC_PHYS_PAGES), page_size = ::sysconf(_SC_PAGE_SIZE);
  if (pages > 0 && page_size > 0) {
    out.bytes = static_cast<int64_t>(pages) * static_cast<int64_t>(page_size);
    out.source = "physical memory";
  }
  // cgroup v2, then v1 (which reports "no limit" as a huge number, above physical memory).
  for (const char* path :
       {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    const int64_t limit = read_limit(path);
    if (limit > 0 && (out.bytes == 0 || limit < out.bytes)) {
      out.bytes = limit;
      out.source = std::string("the cgroup limit (") + path + ")";
      break;
    }
  }
  return out;
}

int64_t cpu_allocator_bound(int64_t peak_in_use) {
  return peak_in_use + peak_in_use / 8 + (int64_t{16} << 20);
}

}  // namespace shardtrain
