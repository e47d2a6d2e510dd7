#include "shardtrain/train/output_dir.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>
#include <vector>

#include "shardtrain/core/error.h"
#include "shardtrain/core/files.h"
#include "shardtrain/core/units.h"
#include "shardtrain/train/run_lock.h"

namespace shardtrain::train {

void prepare_output_dir(const std::string& dir, const std::string& key) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  ST_CHECK_AS(ConfigError, !ec && fs::is_directory(dir), key, " = '", dir,
              "': cannot create the directory (",
              ec ? ec.message() : std::string("a file is in the way"), "); choose a writable path");
  const fs::path probe = fs::path(dir) / (".write-test-" + std::to_string(::getpid()));
  const bool writable = std::ofstream(probe).good();
  fs::remove(probe, ec);
  ST_CHECK_AS(ConfigError, writable, key, " = '", dir,
              "': cannot write files there; choose a writable path");
}

std::string remove_leftover_temporaries(const std::vector<std::string>& dirs) {
  namespace fs = std::filesystem;
  // The files a run writes under temporary names (AtomicFileWriter) outside its checkpoints.
  static const std::regex ours(
      R"((config\.yaml|metrics\.jsonl|config\.json|adapter_config\.json|adapter_model\.safetensors|)"
      R"(model(-\d+-of-\d+)?\.safetensors(\.index\.json)?)\.tmp\.\d+)");
  std::vector<std::string> removed;
  int64_t bytes = 0;
  for (const std::string& dir : dirs)
    for (const LeftoverTemporary& file : leftover_temporaries(dir)) {
      std::error_code ec;
      const auto modified = fs::last_write_time(file.path, ec);
      if (ec || !std::regex_match(fs::path(file.path).filename().string(), ours) ||
          process_runs_here(file.pid) ||
          fs::file_time_type::clock::now() - modified < kLeftoverQuietFor)
        continue;
      if (!fs::remove(file.path, ec) || ec) continue;
      removed.push_back(file.path);
      bytes += static_cast<int64_t>(file.bytes);
    }
  if (removed.empty()) return "";
  std::string list;
  for (size_t i = 0; i < removed.size() && i < 3; ++i) list += (i ? ", " : "") + removed[i];
  if (removed.size() > 3) list += ", ...";
  return "note: removed " + std::to_string(removed.size()) + " temporary file(s) (" +
         format_bytes(bytes) + ") that an earlier run, killed while writing, left behind: " + list;
}

namespace {

// The missing directories of `dir`, innermost first: what prepare_output_dir will create.
std::vector<std::filesystem::path> missing_directories(const std::string& dir) {
  namespace fs = std::filesystem;
  std::vector<fs::path> missing;
  std::error_code ec;
  // The path as written, not normalized: "new/../out" creates "new" too.
  for (fs::path p = fs::path(dir); !p.empty() && !fs::exists(p, ec); p = p.parent_path()) {
    if (p.filename() != "." && p.filename() != ".." && !p.filename().empty()) missing.push_back(p);
    if (p == p.parent_path()) break;
  }
  return missing;
}

}  // namespace

void check_output_dir(const std::string& dir, const std::string& key) {
  const std::vector<std::filesystem::path> missing = missing_directories(dir);
  prepare_output_dir(dir, key);
  std::error_code ec;
  for (const std::filesystem::path& p : missing) std::filesystem::remove(p, ec);  // empty ones
}

DirectoriesOfThisRun::DirectoriesOfThisRun() = default;

void DirectoriesOfThisRun::prepare(const std::string& dir, const std::string& key) {
  std::vector<std::filesystem::path> missing = missing_directories(dir);
  prepare_output_dir(dir, key);
  created_.insert(created_.end(), missing.begin(), missing.end());
}

DirectoriesOfThisRun::~DirectoriesOfThisRun() {
  if (!armed_) return;
  namespace fs = std::filesystem;
  std::error_code ec;
  // Innermost first: a path's absolute form is longer than its parent's, however each was
  // written (relative or absolute).
  auto depth = [&](const fs::path& p) {
    return fs::absolute(p, ec).lexically_normal().native().size();
  };
  std::stable_sort(created_.begin(), created_.end(),
                   [&](const fs::path& a, const fs::path& b) { return depth(a) > depth(b); });
  for (const fs::path& dir : created_) {
    // Something else in its place now (a file) is not this run's to remove.
    if (!fs::is_directory(fs::symlink_status(dir, ec))) continue;
    // The run's lock was released before this runs (the locks are declared after this guard).
    const fs::path lock = dir / RunLock::kFileName;
    if (fs::exists(lock, ec) &&
        std::distance(fs::directory_iterator(dir, ec), fs::directory_iterator()) == 1)
      fs::remove(lock, ec);
    fs::remove(dir, ec);  // only an empty directory goes
  }
}

}  // namespace shardtrain::train
