#include "shardtrain/core/files.h"

#include <filesystem>

#include "shardtrain/core/error.h"

namespace shardtrain {

void check_regular_file(const std::string& path, const std::string& what) {
  std::error_code ec;
  const std::filesystem::file_status status = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(status) || std::filesystem::is_regular_file(status)) return;
  throw ConfigError(what + " '" + path +
                    "' is not a regular file (a FIFO, a device, a directory or a socket): give "
                    "the path of a file");
}

}  // namespace shardtrain
