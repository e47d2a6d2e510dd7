#include "shardtrain/cli/cli.h"

#include <cstdio>

namespace shardtrain::cli {

int main(int argc, char** argv) {
  std::fprintf(stderr, "shardtrain: no subcommands yet\n");
  return 2;
}

}  // namespace shardtrain::cli
