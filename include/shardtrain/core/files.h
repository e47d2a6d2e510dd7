// Input files are opened only once they are known to be regular files: opening a FIFO blocks
// until some writer appears (a hang that no message explains), and a device reads without end.
#pragma once
#include <string>

namespace shardtrain {

// Throws ConfigError "<what> '<path>' is not a regular file (a FIFO, a device, a directory or a
// socket)" when `path` exists and is anything but a regular file (or a link to one). A missing
// path passes: the caller's open reports it in its own words.
void check_regular_file(const std::string& path, const std::string& what);

// Writes `text` to `path` whole or not at all: into `<path>.tmp`, renamed over `path` once
// complete, so a failed write (a full disk, a file-size limit, a kill) leaves the earlier file as
// it was. Throws Error "cannot write <path> (<the system's reason>)", followed by ": <advice>"
// when advice is given; the temporary file is removed.
void write_text_atomically(const std::string& path, const std::string& text,
                           const std::string& advice = "");

}  // namespace shardtrain
