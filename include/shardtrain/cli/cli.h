// The `shardtrain` command line: subcommands, --help, and the top-level error handler that turns
// every shardtrain::Error into a message and a non-zero exit.
//
// Exit codes: 0 success; 1 a shardtrain::Error (bad config, missing file, out of memory, ...);
// 2 a usage mistake (unknown subcommand or flag, missing value); 3 an internal error.
#pragma once
#include <string>
#include <vector>

namespace shardtrain::cli {

int main(int argc, char** argv);

// main() without argv[0]: dispatches `args` ({"config", "--config", "x.yaml"}) to a subcommand,
// prints errors to stderr and returns the exit code.
int run(const std::vector<std::string>& args);

}  // namespace shardtrain::cli
