#include "shardtrain/data/prepare.h"

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
                            const std::string& tokenizer_name) {
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

  TokenDatasetWriter writer(output_h5, tokenizer->vocab_size(), tokenizer->name());
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
    const auto total = static_cast<int64_t>(std::filesystem::file_size(input, ec));
    std::ifstream in(input, std::ios::binary);
    if (!in) throw ConfigError(concat("cannot read '", input, "': ", std::strerror(errno)));
    const bool progress = total > kProgressAboveBytes;
    // A byte tokenizer may cut anywhere; chunk boundaries do not change its output.
    std::string chunk(kChunkBytes, '\0');
    int64_t done = 0;
    while (in) {
      in.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
      const auto got = static_cast<size_t>(in.gcount());
      if (got == 0) break;
      consume(std::string_view(chunk.data(), got));
      done += static_cast<int64_t>(got);
      if (progress)
        std::fprintf(stderr, "\rprepare-data: %s / %s (%d%%)", format_bytes(done).c_str(),
                     format_bytes(total).c_str(),
                     static_cast<int>(100.0 * static_cast<double>(done) /
                                      static_cast<double>(std::max<int64_t>(total, 1))));
    }
    if (in.bad()) throw ConfigError(concat("error while reading '", input, "'"));
    if (progress) std::fprintf(stderr, "\n");
  }
  ST_CHECK_AS(ConfigError, writer.size() > 0, "input '", input, "' is empty: nothing to train on");
  summary.num_tokens = writer.size();
  summary.unigram_entropy_bits = counts.entropy_bits();
  writer.commit();
  return summary;
}

}  // namespace shardtrain
