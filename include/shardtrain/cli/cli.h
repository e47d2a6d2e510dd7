// The `shardtrain` command line: subcommands, --help, and the top-level error handler that turns
// every shardtrain::Error into a message and a non-zero exit.
#pragma once

namespace shardtrain::cli {

int main(int argc, char** argv);

}  // namespace shardtrain::cli
