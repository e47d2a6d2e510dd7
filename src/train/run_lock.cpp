#include "shardtrain/train/run_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "shardtrain/core/error.h"

namespace shardtrain::train {

using detail::concat;

RunLock::RunLock(const std::string& dir, const std::string& key) {
  const std::string path = dir + "/" + kFileName;
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0)
    throw ConfigError(concat(key, " = '", dir, "': cannot create ", path, " (",
                             std::strerror(errno), "); choose a writable directory"));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    if (err == EWOULDBLOCK) {
      char holder[32] = {};
      const ssize_t n = ::pread(fd_, holder, sizeof holder - 1, 0);
      ::close(fd_);
      fd_ = -1;
      std::string pid = n > 0 ? std::string(holder, static_cast<size_t>(n)) : std::string("?");
      while (!pid.empty() && (pid.back() == '\n' || pid.back() == ' ')) pid.pop_back();
      throw ConfigError(concat(key, " = '", dir, "' is in use by another run (pid ", pid, " holds ",
                               path, "): wait for it to end, or give this run another ", key));
    }
    if (err == ENOLCK || err == EOPNOTSUPP) {
      unlocked_reason_ = concat("note: ", path, " cannot be locked on this file system (",
                                std::strerror(err), "): make sure no other run uses ", dir);
      return;
    }
    ::close(fd_);
    fd_ = -1;
    throw ConfigError(
        concat(key, " = '", dir, "': cannot lock ", path, " (", std::strerror(err), ")"));
  }
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd_, 0) == 0) {
    const ssize_t written = ::pwrite(fd_, pid.data(), pid.size(), 0);
    (void)written;  // the pid is for the message of a second run; the lock is what matters
  }
}

RunLock::~RunLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock
}

}  // namespace shardtrain::train
