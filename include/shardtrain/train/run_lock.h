// One run per directory: two trainings writing the same train.out_dir (or checkpoint.dir) would
// interleave their metrics and mix their checkpoints' temporary files. A RunLock holds an
// exclusive flock(2) on `<dir>/.shardtrain.lock` for its lifetime (released by the kernel
// if the process dies, so a crashed run leaves nothing to clean up) and writes its pid there.
#pragma once
#include <string>

namespace shardtrain::train {

class RunLock {
 public:
  static constexpr const char* kFileName = ".shardtrain.lock";

  // Throws ConfigError naming `key`, the directory and the holder's pid when another process
  // holds the lock. On a file system without locks (ENOLCK, EOPNOTSUPP) the run goes on
  // unlocked, and `unlocked_reason()` says why (for the log).
  RunLock(const std::string& dir, const std::string& key);
  ~RunLock();
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

  const std::string& unlocked_reason() const { return unlocked_reason_; }

 private:
  int fd_ = -1;
  std::string unlocked_reason_;
};

}  // namespace shardtrain::train
