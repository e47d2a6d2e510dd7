#include "shardtrain/train/output_dir.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>

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

}  // namespace shardtrain::train
