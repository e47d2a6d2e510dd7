#include "shardtrain/core/files.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>

#include "shardtrain/core/error.h"

namespace shardtrain {

namespace fs = std::filesystem;

void check_regular_file(const std::string& path, const std::string& what) {
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (ec || !fs::exists(status) || fs::is_regular_file(status)) return;
  throw ConfigError(what + " '" + path +
                    "' is not a regular file (a FIFO, a device, a directory or a socket): give "
                    "the path of a file");
}

void sync_to_disk(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | (directory ? O_DIRECTORY : 0));
  if (fd < 0) throw Error("cannot open '" + path + "' to sync it to disk: " + std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0 && !(directory && err == EINVAL))
    throw Error("cannot sync '" + path + "' to disk: " + std::strerror(err));
}

namespace {

// After a rename into it, the directory holding `path` is synced so the rename survives a power
// loss. One that cannot be synced leaves a complete file under its final name either way, so
// that is not worth a failure (which would tell the caller the file is not there when it is).
void sync_directory_after_rename(const std::string& path) {
  const fs::path dir = fs::path(path).parent_path();
  try {
    sync_to_disk(dir.empty() ? "." : dir.string(), true);
  } catch (const Error&) {
  }
}

}  // namespace

void rename_durably(const std::string& from, const std::string& to) {
  std::error_code ec;
  fs::rename(from, to, ec);
  if (ec) throw Error("cannot rename '" + from + "' to '" + to + "': " + ec.message());
  sync_directory_after_rename(to);
}

std::vector<LeftoverTemporary> leftover_temporaries(const std::string& dir,
                                                    const std::string& name) {
  std::vector<LeftoverTemporary> found;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string file = it->path().filename().string();
    const size_t at = file.rfind(".tmp.");
    if (at == std::string::npos || at == 0 || (!name.empty() && file.substr(0, at) != name))
      continue;
    const std::string digits = file.substr(at + 5);
    if (digits.empty() || digits.size() > 9 ||
        !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
      continue;
    const int64_t pid = std::stoll(digits);
    std::error_code status_ec;
    if (pid == ::getpid() || !it->is_regular_file(status_ec)) continue;
    const uintmax_t bytes = it->file_size(status_ec);
    found.push_back({it->path().string(), pid, status_ec ? 0 : bytes});
  }
  std::sort(found.begin(), found.end(),
            [](const LeftoverTemporary& a, const LeftoverTemporary& b) { return a.path < b.path; });
  return found;
}

bool process_runs_here(int64_t pid) {
  if (pid <= 0 || pid > std::numeric_limits<pid_t>::max()) return false;
  return ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM;
}

AtomicFileWriter::AtomicFileWriter(std::string path, std::string advice)
    : path_(std::move(path)),
      tmp_path_(path_ + ".tmp." + std::to_string(::getpid())),
      advice_(std::move(advice)) {
  fd_ = ::open(tmp_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail(errno);
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(tmp_path_.c_str());
}

void AtomicFileWriter::write(const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd_, p, std::min<size_t>(bytes, size_t{1} << 30));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail(n == 0 ? ENOSPC : errno);  // no progress and no error: nothing more fits
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

void AtomicFileWriter::write_at(int64_t offset, const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::pwrite(fd_, p, std::min<size_t>(bytes, size_t{1} << 30), offset);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail(n == 0 ? ENOSPC : errno);
    p += n;
    offset += n;
    bytes -= static_cast<size_t>(n);
  }
}

void AtomicFileWriter::commit() {
  if (::fsync(fd_) != 0) fail(errno);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) fail(errno);
  if (::rename(tmp_path_.c_str(), path_.c_str()) != 0) fail(errno);
  committed_ = true;
  sync_directory_after_rename(path_);
}

void AtomicFileWriter::fail(int err) const {
  throw Error("cannot write " + path_ + " (" + std::strerror(err) + ")" +
              (advice_.empty() ? "" : ": " + advice_));
}

void write_file_atomically(const std::string& path, std::string_view bytes,
                           const std::string& advice) {
  AtomicFileWriter out(path, advice);
  out.write(bytes.data(), bytes.size());
  out.commit();
}

}  // namespace shardtrain
