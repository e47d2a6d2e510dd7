// Directories a run or a benchmark writes into, checked when it starts: a path that cannot serve
// fails before the first step (or the first combination), not at the first write hours later.
#pragma once
#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

namespace shardtrain::train {

// Creates `dir` (and its parents) and checks that a file can be made and removed there. Throws
// ConfigError "<key> = '<dir>': ..." naming what is wrong (the system's reason, or a file in
// the way).
void prepare_output_dir(const std::string& dir, const std::string& key);

// The same check for a directory written only at the end (the export, the adapter): the
// directories it had to create are removed again, so a run refused or stopped before its end
// leaves no empty ones behind. The writer creates them when it writes.
void check_output_dir(const std::string& dir, const std::string& key);

// Removes the temporary files (`<name>.tmp.<pid>`, see core/files.h) that an earlier run killed
// mid-write (SIGKILL, the OOM killer, a power loss) left in `dirs`: an export's shard files may
// be gigabytes. For directories whose run lock this process holds. A file goes only when all of
// these say no one is writing it: its name is one a run writes (config.yaml, metrics.jsonl,
// config.json, model*.safetensors, the index, the adapter's files), its pid runs no process on
// this machine, and it has not changed for kLeftoverQuietFor (a writer on another machine of a
// shared file system, which the lock may not see, keeps it changing). Returns a note naming what
// was removed and its size ("" when nothing was).
inline constexpr std::chrono::seconds kLeftoverQuietFor{60};
std::string remove_leftover_temporaries(const std::vector<std::string>& dirs);
// The directories a run creates as it starts, taken back at its end when they are still empty: a
// run refused after start-up (data that does not fit the model, out of memory at the first step)
// leaves nothing behind, and a run that saved no checkpoint no empty checkpoint directory. One
// that received files stays; a run lock file (train/run_lock.h) alone does not count, as the
// lock ends with the run.
class DirectoriesOfThisRun {
 public:
  DirectoriesOfThisRun();
  // Removes the created directories still empty, innermost first, once take_back_at_end() was
  // called.
  ~DirectoriesOfThisRun();
  DirectoriesOfThisRun(const DirectoriesOfThisRun&) = delete;
  DirectoriesOfThisRun& operator=(const DirectoriesOfThisRun&) = delete;

  // prepare_output_dir(dir, key), remembering the directories it had to create.
  void prepare(const std::string& dir, const std::string& key);
  // Call once this run holds the directories' run locks: until then the directories may be
  // another run's, which created them at the same moment and won the lock.
  void take_back_at_end() { armed_ = true; }

 private:
  std::vector<std::filesystem::path> created_;
  bool armed_ = false;
};

}  // namespace shardtrain::train
