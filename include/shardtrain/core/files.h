// Files as this project reads and writes them. Input files are opened only once they are known
// to be regular files: opening a FIFO blocks until some writer appears (a hang that no message
// explains), and a device reads without end. Output files are written whole or not at all: under
// a temporary name, synced, then renamed over the final name, so a crash, a full disk or a kill
// leaves the earlier file as it was.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace shardtrain {

// Throws ConfigError "<what> '<path>' is not a regular file (a FIFO, a device, a directory or a
// socket)" when `path` exists and is anything but a regular file (or a link to one). A missing
// path passes: the caller's open reports it in its own words.
void check_regular_file(const std::string& path, const std::string& what);

// Flushes a closed file (or, with `directory`, a directory's entries) to stable storage. Some
// file systems cannot sync directories (EINVAL): their renames are as durable as they get.
// Throws Error naming the path and the system's reason.
void sync_to_disk(const std::string& path, bool directory);

// Renames `from` over `to`, then syncs the directory holding `to` so the rename itself survives
// a power loss. Throws Error naming both paths when the rename fails. A directory that cannot be
// synced once the rename is done is not a failure: the complete file is under its final name
// either way (AtomicFileWriter::commit does the same).
void rename_durably(const std::string& from, const std::string& to);

// A temporary file of a writer that never committed: `<name>.tmp.<pid>` (AtomicFileWriter's and
// TokenDatasetWriter's naming) left by a process killed before its rename (SIGKILL, the OOM
// killer, a power loss). Its own stop signals remove it; these cannot.
struct LeftoverTemporary {
  std::string path;
  int64_t pid = 0;  // of the process that wrote it
  uintmax_t bytes = 0;
};
// The regular files in `dir` named `<name>.tmp.<pid>`, for the given `name` ("" = any), whose
// pid is not this process's. Whether that process is still writing is for the
// caller to know (a directory lock it holds) or ask (process_runs_here). Empty when `dir` cannot
// be read.
std::vector<LeftoverTemporary> leftover_temporaries(const std::string& dir,
                                                    const std::string& name = "");
// Whether a process with this pid runs on this machine (kill(pid, 0)). A file system shared
// between machines may hold another machine's live writer's file.
bool process_runs_here(int64_t pid);

// A file written under `<path>.tmp.<pid>` and renamed over `path` by commit() once complete and
// on disk. Dropped without commit(), it removes the temporary file and leaves `path` untouched.
// Every failure throws Error "cannot write <path> (<the system's reason>)", followed by
// ": <advice>" when advice is given.
class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(std::string path, std::string advice = "");
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  // Appends at the current position.
  void write(const void* data, size_t bytes);
  // Writes at byte `offset`, leaving the current position alone: parts of a file may arrive in
  // any order, and a gap is filled by a later write.
  void write_at(int64_t offset, const void* data, size_t bytes);
  // fsync, close, rename over the final path, sync the directory.
  void commit();

  const std::string& path() const { return path_; }
  const std::string& temporary_path() const { return tmp_path_; }

 private:
  [[noreturn]] void fail(int err) const;

  std::string path_;
  std::string tmp_path_;
  std::string advice_;
  int fd_ = -1;
  bool committed_ = false;
};

// Writes `bytes` (a whole file: text or binary) to `path` through an AtomicFileWriter.
void write_file_atomically(const std::string& path, std::string_view bytes,
                           const std::string& advice = "");

}  // namespace shardtrain
