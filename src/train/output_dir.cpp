#include "shardtrain/train/output_dir.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <vector>

#include "shardtrain/core/error.h"

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

void check_output_dir(const std::string& dir, const std::string& key) {
  namespace fs = std::filesystem;
  // The missing directories, innermost first: what prepare_output_dir will create.
  std::vector<fs::path> missing;
  std::error_code ec;
  // The path as written, not normalized: "new/../out" creates "new" too.
  for (fs::path p = fs::path(dir); !p.empty() && !fs::exists(p, ec); p = p.parent_path()) {
    if (p.filename() != "." && p.filename() != ".." && !p.filename().empty()) missing.push_back(p);
    if (p == p.parent_path()) break;
  }
  prepare_output_dir(dir, key);
  for (const fs::path& p : missing) fs::remove(p, ec);  // only empty ones go
}

}  // namespace shardtrain::train
