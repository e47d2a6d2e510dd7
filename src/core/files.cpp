#include "shardtrain/core/files.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

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

void write_text_atomically(const std::string& path, const std::string& text,
                           const std::string& advice) {
  const std::string temporary = path + ".tmp";
  std::ofstream out(temporary, std::ios::trunc);
  out << text;
  out.close();
  const int err = errno;
  std::error_code ec;
  if (out.good()) std::filesystem::rename(temporary, path, ec);
  if (out.good() && !ec) return;
  const std::string reason = out.good() ? ec.message() : std::strerror(err);
  std::filesystem::remove(temporary, ec);
  throw Error("cannot write " + path + " (" + reason + ")" + (advice.empty() ? "" : ": " + advice));
}

}  // namespace shardtrain
