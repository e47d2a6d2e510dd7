// Directories a run or a benchmark writes into, checked when it starts: a path that cannot serve
// fails before the first step (or the first combination), not at the first write hours later.
#pragma once
#include <string>

namespace shardtrain::train {

// Creates `dir` (and its parents) and checks that a file can be made and removed there. Throws
// ConfigError "<key> = '<dir>': ..." naming what is wrong (the system's reason, or a file in
// the way).
void prepare_output_dir(const std::string& dir, const std::string& key);

// The same check for a directory written only at the end (the export, the adapter): the
// directories it had to create are removed again, so a run refused or stopped before its end
// leaves no empty ones behind. The writer creates them when it writes.
void check_output_dir(const std::string& dir, const std::string& key);

}  // namespace shardtrain::train
