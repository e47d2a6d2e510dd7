// Input files are opened only once they are known to be regular files: opening a FIFO blocks
// until some writer appears (a hang that no message explains), and a device reads without end.
#pragma once
#include <string>

namespace shardtrain {

// Throws ConfigError "<what> '<path>' is not a regular file (a FIFO, a device, a directory or a
// socket)" when `path` exists and is anything but a regular file (or a link to one). A missing
// path passes: the caller's open reports it in its own words.
void check_regular_file(const std::string& path, const std::string& what);

}  // namespace shardtrain
