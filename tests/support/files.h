// Reading files back in tests: whole files as bytes, directory listings, and two directories
// compared file for file.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace shardtrain::testing {

// A pid no process can have: one past the kernel's pid_max (a reaped child's pid may be reused).
inline int64_t pid_of_no_process() {
  std::ifstream in("/proc/sys/kernel/pid_max");
  int64_t pid_max = int64_t{1} << 22;  // the largest pid_max Linux allows
  in >> pid_max;
  return pid_max + 1;
}

// The whole file as bytes ("" when it cannot be read).
inline std::string read_file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The names of the entries of `dir`, sorted.
inline std::vector<std::string> files_in(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// `got` holds the same file names as `want`, each with the same bytes.
inline void expect_same_files(const std::string& got, const std::string& want,
                              const std::string& tag = "") {
  ASSERT_EQ(files_in(got), files_in(want)) << tag;
  for (const std::string& name : files_in(want))
    EXPECT_TRUE(read_file_bytes(got + "/" + name) == read_file_bytes(want + "/" + name))
        << tag << (tag.empty() ? "" : ": ") << name << " differs from " << want << "/" << name;
}

}  // namespace shardtrain::testing
