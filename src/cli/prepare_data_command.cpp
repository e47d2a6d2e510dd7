// `shardtrain prepare-data`: tokenizes a text file (or the built-in corpus) into an HDF5 token
// dataset that data.path can point at.
#include <fmt/format.h>
#include <cstdio>
#include <iostream>

#include "shardtrain/cli/command.h"
#include "shardtrain/core/units.h"
#include "shardtrain/data/prepare.h"
#include "shardtrain/train/checkpointing.h"

namespace shardtrain::cli {

Command prepare_data_command() {
  Command c;
  c.name = "prepare-data";
  c.summary = "tokenize a text file (or the built-in corpus) into an .h5 token dataset";
  c.description =
      "The dataset records its tokenizer and vocabulary size; point data.path at it to train on\n"
      "it. The byte tokenizer maps every byte to its own token (vocabulary 256).";
  c.flags = {
      Flag("input", "FILE|builtin", "text file to tokenize, or builtin for the built-in corpus")
          .mandatory(),
      Flag("output", "FILE.h5", "token dataset to write (replaced atomically)").mandatory(),
      Flag("tokenizer", "NAME", "tokenizer").defaults_to("byte"),
  };
  c.run = [](const Args& args) {
    // SIGINT/SIGTERM end the tokenizing between chunks, and the writer removes its temporary
    // file: an interrupted run leaves nothing behind (a second SIGINT ends it at once).
    train::StopSignalHandlers stop_on_signal;
    PrepareSummary s = prepare_data(args.get("input"), args.get("output"), args.get("tokenizer"),
                                    [] { return train::stop_signal() != 0; });
    const std::string entropy = fmt::format("{:.3f}", s.unigram_entropy_bits);
    std::cout << "wrote " << s.output << ": " << s.num_tokens << " tokens from " << s.source
              << " (tokenizer " << s.tokenizer << ", vocabulary " << s.vocab_size
              << ", unigram entropy " << entropy << " bits/token)\n";
    return 0;
  };
  return c;
}

}  // namespace shardtrain::cli
