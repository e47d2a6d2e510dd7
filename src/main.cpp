// The shardtrain binary: every subcommand lives in the cli layer.
#include "shardtrain/cli/cli.h"

int main(int argc, char** argv) {
  return shardtrain::cli::main(argc, argv);
}
