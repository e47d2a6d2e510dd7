#include "shardtrain/data/prepare.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <vector>

#include "shardtrain/core/error.h"
#include "shardtrain/core/hdf5.h"
#include "shardtrain/core/units.h"
#include "shardtrain/data/corpus.h"
#include "shardtrain/data/token_dataset.h"
#include "shardtrain/data/tokenizer.h"

namespace shardtrain {

using detail::concat;

namespace {

constexpr size_t kChunkBytes = size_t{16} << 20;
constexpr int64_t kProgressAboveBytes = int64_t{64} << 20;

}  // namespace

PrepareSummary prepare_data(const std::string& input, const std::string& output_h5,
                            const std::string& tokenizer_name,
                            const std::function<bool()>& stop_requested) {
  // The output is checked before any input is read: a bad name would otherwise surface only at
  // the end, after minutes of tokenizing, or as the temporary file's name.
  ST_CHECK_AS(ConfigError, !output_h5.empty(),
              "prepare-data: --output is empty; name the .h5 "
              "file to write");
  ST_CHECK_AS(ConfigError, !names_text_corpus(output_h5), "prepare-data: --output '", output_h5,
              "' is named like text, but a token dataset is HDF5 (data.path would read a .txt "
              "file as text): name it .h5");
  {
    const std::filesystem::path parent = std::filesystem::path(output_h5).parent_path();
    std::error_code ec;
    ST_CHECK_AS(ConfigError, parent.empty() || std::filesystem::is_directory(parent, ec),
                "prepare-data: the directory of --output '", output_h5, "' ('", parent.string(),
                std::filesystem::exists(parent, ec) ? "') is not a directory"
                                                    : "') does not exist: create it first");
  }
  if (input != "builtin") {
    std::error_code ec;
    ST_CHECK_AS(ConfigError, !std::filesystem::equivalent(input, output_h5, ec),
                "prepare-data: --input and --output are the same file ('", input,
                "'); the output replaces its file, so write the token dataset elsewhere");
    ST_CHECK_AS(ConfigError, !h5::has_hdf5_signature(input), "prepare-data: --input '", input,
                "' is an HDF5 file (a token dataset already?); --input takes text to tokenize");
  }
  auto tokenizer = make_tokenizer(tokenizer_name);
  PrepareSummary summary;
  summary.source = input;
  summary.output = output_h5;
  summary.tokenizer = tokenizer->name();
  summary.vocab_size = tokenizer->vocab_size();

  // The byte tokenizer gives a token a byte: the input's size sizes the dataset's chunks.
  std::error_code size_ec;
  int64_t input_bytes =
      input == "builtin" ? 0 : static_cast<int64_t>(std::filesystem::file_size(input, size_ec));
  if (size_ec) input_bytes = 0;
  TokenDatasetWriter writer(output_h5, tokenizer->vocab_size(), tokenizer->name(), input_bytes);
  TokenCounts counts;
  auto consume = [&](std::string_view text) {
    std::vector<uint32_t> tokens = tokenizer->encode(text);
    counts.add(tokens);
    writer.append(tokens);
  };

  if (input == "builtin") {
    consume(builtin_corpus());
  } else {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(input, ec))
      throw ConfigError(concat("input text '", input,
                               "' does not exist or is not a file (use \"builtin\" for the "
                               "generated corpus)"));
    const int64_t total = input_bytes;
    std::ifstream in(input, std::ios::binary);
    if (!in) throw ConfigError(concat("cannot read '", input, "': ", std::strerror(errno)));
    const bool progress = total > kProgressAboveBytes;
    // Redrawn in place on a terminal; into a log (a pipe, a file) a line every tenth instead of
    // one line of carriage returns.
    const bool terminal = isatty(STDERR_FILENO) != 0;
    int next_tenth = 1;
    // A byte tokenizer may cut anywhere; chunk boundaries do not change its output.
    std::string chunk(kChunkBytes, '\0');
    int64_t done = 0;
    while (in) {
      if (stop_requested && stop_requested()) {
        if (progress && terminal) std::fprintf(stderr, "\n");
        throw Error(concat("prepare-data: stopped by a signal after ", format_bytes(done), " of '",
                           input, "'; nothing was written"));
      }
      in.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
      const auto got = static_cast<size_t>(in.gcount());
      if (got == 0) break;
      // Text holds no NUL bytes; a binary file (compressed text, a token array) does, and its
      // bytes would make a dataset of noise (load_token_source refuses such a .txt the same way).
      if (const void* nul = std::memchr(chunk.data(), '\0', got))
        throw ConfigError(
            concat("prepare-data: --input '", input, "' holds a NUL byte at offset ",
                   done + (static_cast<const char*>(nul) - chunk.data()),
                   ", so it is not text (compressed? decompress it first); --input takes text"));
      consume(std::string_view(chunk.data(), got));
      done += static_cast<int64_t>(got);
      const int percent = static_cast<int>(100.0 * static_cast<double>(done) /
                                           static_cast<double>(std::max<int64_t>(total, 1)));
      if (progress && (terminal || percent >= 10 * next_tenth)) {
        std::fprintf(stderr, "%sprepare-data: %s / %s (%d%%)%s", terminal ? "\r" : "",
                     format_bytes(done).c_str(), format_bytes(total).c_str(), percent,
                     terminal ? "" : "\n");
        while (percent >= 10 * next_tenth) ++next_tenth;
      }
    }
    if (in.bad()) throw ConfigError(concat("error while reading '", input, "'"));
    if (progress && terminal) std::fprintf(stderr, "\n");
  }
  // A stop asked for after the last chunk still counts: the output is not committed.
  if (stop_requested && stop_requested())
    throw Error(concat("prepare-data: stopped by a signal before '", output_h5,
                       "' was written; nothing was written"));
  ST_CHECK_AS(ConfigError, writer.size() > 0, "input '", input, "' is empty: nothing to train on");
  summary.num_tokens = writer.size();
  summary.unigram_entropy_bits = counts.entropy_bits();
  writer.commit();
  return summary;
}

}  // namespace shardtrain
