// `shardtrain prepare-data`: tokenizes a text file (or the built-in corpus) into an HDF5 token
// dataset that data.path can point at.
#include <fmt/format.h>
#include <cstdio>
#include <filesystem>
#include <iostream>

#include "shardtrain/cli/command.h"
#include "shardtrain/core/files.h"
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
    // A kill that no handler sees (SIGKILL, the OOM killer) leaves the temporary file, perhaps
    // gigabytes. Another machine sharing the directory may be writing one right now, so they are
    // named, not removed.
    const std::filesystem::path output(args.get("output"));
    for (const LeftoverTemporary& file :
         leftover_temporaries(output.parent_path().empty() ? "." : output.parent_path().string(),
                              output.filename().string()))
      if (!process_runs_here(file.pid))
        std::cerr << "note: "
                  << (output.parent_path().empty()
                          ? std::filesystem::path(file.path).filename().string()
                          : file.path)
                  << " (" << format_bytes(static_cast<int64_t>(file.bytes))
                  << ") is the temporary file of an earlier prepare-data (process " << file.pid
                  << ", no longer running on this machine) that was killed while writing; "
                     "remove it to free the space\n";
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
