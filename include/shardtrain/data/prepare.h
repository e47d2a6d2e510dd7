// Turning a text file (or the built-in corpus) into a token dataset: `shardtrain prepare-data`.
#pragma once
#include <cstdint>
#include <functional>
#include <string>

namespace shardtrain {

struct PrepareSummary {
  std::string source;  // the input path, or "builtin"
  std::string output;
  std::string tokenizer;
  int64_t vocab_size = 0;
  int64_t num_tokens = 0;
  double unigram_entropy_bits = 0.0;  // bits per token
};

// Tokenizes `input` (a text file path, or "builtin" for the generated corpus) with the tokenizer
// called `tokenizer` and writes the token dataset `output_h5` atomically. Inputs above 64 MiB get
// a progress line on stderr. Throws ConfigError for an unreadable input, input that is not text
// (a NUL byte), an output path that cannot be a token dataset (empty, named .txt, in a missing
// directory) or an unknown tokenizer. `stop_requested`, when given, is asked between chunks of
// 16 MiB: once it returns true this throws Error and leaves no file behind.
PrepareSummary prepare_data(const std::string& input, const std::string& output_h5,
                            const std::string& tokenizer = "byte",
                            const std::function<bool()>& stop_requested = {});

}  // namespace shardtrain
