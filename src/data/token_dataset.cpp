#include "shardtrain/data/token_dataset.h"

#include <sys/stat.h>
#include <unistd.h>
#include <cctype>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "shardtrain/core/error.h"
#include "shardtrain/core/files.h"
#include "shardtrain/core/word_hash.h"
#include "shardtrain/data/corpus.h"
#include "shardtrain/data/tokenizer.h"

namespace shardtrain {

using detail::concat;

namespace {

constexpr const char* kTokensName = "tokens";
constexpr int64_t kMaxVocab = int64_t{1} << 32;
// The writer's chunks: about kChunksPerDataset of them for the expected size, from 64 Ki to
// 16 Mi tokens each. Every chunk is allocated whole, so a small dataset needs small ones; few
// chunks keep a large one mappable (h5::Dataset::kMaxChunksToMap) and quick to open.
constexpr int64_t kChunksPerDataset = 1024;
constexpr int64_t kChunkElementsMin = int64_t{1} << 16;
constexpr int64_t kChunkElementsMax = int64_t{1} << 24;

hsize_t chunk_elements_for(int64_t expected_tokens) {
  int64_t chunk = kChunkElementsMin;
  while (chunk < kChunkElementsMax && chunk * kChunksPerDataset < expected_tokens) chunk *= 2;
  return static_cast<hsize_t>(chunk);
}

}  // namespace

// ---- writing ----------------------------------------------------------------------------------

TokenDatasetWriter::TokenDatasetWriter(const std::string& path, int64_t vocab_size,
                                       const std::string& tokenizer, int64_t expected_tokens)
    : path_(path),
      tmp_path_(concat(path, ".tmp.", ::getpid())),
      vocab_size_(vocab_size),
      narrow_(vocab_size <= 65536) {
  ST_CHECK_AS(ConfigError, vocab_size >= 1 && vocab_size <= kMaxVocab, "cannot write '", path,
              "': vocab_size ", vocab_size, " is outside [1, 2^32]");
  // The finished file is renamed over `path`: only a regular file may be replaced that way (a
  // directory cannot be, and a FIFO or device node would be silently swapped for the dataset).
  std::error_code ec;
  const std::filesystem::file_status existing = std::filesystem::symlink_status(path, ec);
  ST_CHECK_AS(ConfigError,
              !std::filesystem::exists(existing) || std::filesystem::is_regular_file(existing) ||
                  std::filesystem::is_symlink(existing),
              "cannot write the token dataset to '", path, "': it exists and is not a regular file",
              std::filesystem::is_directory(existing)
                  ? concat(" but a directory; name a file in it, e.g. ", path, "/tokens.h5")
                  : std::string(" but a FIFO, socket or device; name a file to write"));
  file_ = std::make_unique<h5::File>(h5::File::create(tmp_path_));
  dataset_ = std::make_unique<h5::Dataset>(file_->create_extendible_1d(
      kTokensName, narrow_ ? H5T_STD_U16LE : H5T_STD_U32LE, chunk_elements_for(expected_tokens)));
  dataset_->write_int64_attribute("vocab_size", vocab_size);
  dataset_->write_string_attribute("tokenizer", tokenizer);
}

TokenDatasetWriter::~TokenDatasetWriter() {
  if (committed_) return;
  dataset_.reset();
  file_.reset();
  std::remove(tmp_path_.c_str());
}

void TokenDatasetWriter::append(const uint32_t* tokens, size_t count) {
  ST_CHECK_AS(ConfigError, !committed_, "cannot append to '", path_, "' after commit()");
  for (size_t i = 0; i < count; ++i)
    ST_CHECK_AS(ConfigError, tokens[i] < vocab_size_, "cannot write '", path_, "': token ",
                tokens[i], " at position ", size_ + static_cast<int64_t>(i), " is >= vocab_size ",
                vocab_size_);
  if (narrow_) {
    std::vector<uint16_t> narrow(tokens, tokens + count);
    dataset_->append(narrow.data(), H5T_NATIVE_UINT16, count);
  } else {
    dataset_->append(tokens, H5T_NATIVE_UINT32, count);
  }
  size_ += static_cast<int64_t>(count);
}

void TokenDatasetWriter::commit() {
  ST_CHECK_AS(ConfigError, !committed_, "'", path_, "' was already committed");
  dataset_.reset();
  file_->close();
  file_.reset();
  sync_to_disk(tmp_path_, false);
  rename_durably(tmp_path_, path_);
  committed_ = true;
}

void write_token_dataset(const std::string& path, const std::vector<uint32_t>& tokens,
                         int64_t vocab_size, const std::string& tokenizer) {
  TokenDatasetWriter writer(path, vocab_size, tokenizer, static_cast<int64_t>(tokens.size()));
  writer.append(tokens);
  writer.commit();
}

// ---- reading ----------------------------------------------------------------------------------

TokenDataset::FileStamp TokenDataset::stamp_of(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return {};
  return {static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino),
          static_cast<int64_t>(st.st_size),
          static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec};
}

std::string TokenDataset::changed_on_disk() const {
  if (!memory_mapped() || opened_.size < 0) return "";
  const FileStamp now = stamp_of(mapped_path_);
  if (now.size < 0 || now.device != opened_.device || now.inode != opened_.inode) return "";
  if (now.size == opened_.size && now.modified_ns == opened_.modified_ns) return "";
  return concat(mapped_path_ != source_ ? "holds its tokens in '" + mapped_path_ + "', which " : "",
                "was written over in place (", opened_.size, " bytes when opened, ", now.size,
                " now)");
}

TokenDataset TokenDataset::open(const std::string& path) {
  FileStamp opened = stamp_of(path);  // before reading: a change while validating counts
  h5::File file = h5::File::open(path);
  if (!file.has(kTokensName))
    throw FormatError(concat(path,
                             ": no dataset 'tokens'; a token dataset holds a 1-D uint16 or "
                             "uint32 dataset 'tokens' with an attribute 'vocab_size' "
                             "(`shardtrain prepare-data` writes one)"));
  h5::Dataset ds = file.open_dataset(kTokensName);
  // Reached through an external link, the tokens are in another file: that one is mapped, and
  // watched for changes.
  const std::string held_in = ds.file_name();
  if (held_in != path) opened = stamp_of(held_in);
  if (ds.rank() != 1)
    throw FormatError(
        concat(path, ": dataset 'tokens' has rank ", ds.rank(), ", expected a 1-D token stream"));
  const h5::TypeInfo type = ds.type();
  if (type.type_class != H5T_INTEGER || type.is_signed || (type.size != 2 && type.size != 4))
    throw FormatError(concat(path, ": dataset 'tokens' holds ", type.describe(),
                             " elements, expected uint16 or uint32"));

  // Attributes belong on the dataset; the file's root is accepted too, as other writers do that.
  auto owner = [&](const char* name) -> const h5::Object* {
    if (ds.has_attribute(name)) return &ds;
    if (file.has_attribute(name)) return &file;
    return nullptr;
  };
  TokenDataset out;
  out.source_ = path;
  out.opened_ = opened;
  out.mapped_path_ = held_in;
  const h5::Object* vocab_size = owner("vocab_size");
  if (vocab_size == nullptr)
    throw FormatError(concat(path,
                             ": dataset 'tokens' has no attribute 'vocab_size' (the vocabulary "
                             "size, an integer): add it, or write the file with `shardtrain "
                             "prepare-data`"));
  out.vocab_size_ = vocab_size->read_int64_attribute("vocab_size");
  if (out.vocab_size_ < 1 || out.vocab_size_ > kMaxVocab)
    throw FormatError(concat(path, ": vocab_size ", out.vocab_size_, " is outside [1, 2^32]"));
  // What made the tokens, for the reader: optional (other writers may not record it).
  if (const h5::Object* tokenizer = owner("tokenizer"))
    out.tokenizer_ = tokenizer->read_string_attribute("tokenizer");

  if (ds.num_elements() == 0) throw FormatError(concat(path, ": dataset 'tokens' holds no tokens"));
  ds.check_stored_here();
  out.storage_ = map_token_dataset(ds);
  if (!out.storage_) {  // compressed or big-endian: HDF5 decodes it, into memory
    if (const int64_t chunks = ds.num_chunks(); chunks > h5::Dataset::kMaxChunksToMap)
      out.why_not_mapped_ = concat(
          "it is stored in ", chunks, " chunks, more than the ", h5::Dataset::kMaxChunksToMap,
          " whose places are looked up for mapping (HDF5 takes time growing with the square of "
          "the count); rewrite it contiguous to map it (`h5repack -l tokens:CONTI IN.h5 "
          "OUT.h5`), or write it with prepare-data, which stores at most about ",
          kChunksPerDataset, " chunks");
    std::vector<uint32_t> tokens(static_cast<size_t>(ds.num_elements()));
    ds.read(tokens.data(), H5T_NATIVE_UINT32);
    out.storage_ = tokens_in_memory(std::move(tokens));
  }
  // One pass over every token, a block at a time: each must be in the vocabulary (a token past
  // it would index outside the embedding), and the counts give the unigram entropy.
  TokenCounts counts;
  WordHash hash;
  std::vector<uint32_t> block(size_t{1} << 20);
  for (int64_t begin = 0; begin < out.size(); begin += static_cast<int64_t>(block.size())) {
    const int64_t count = std::min<int64_t>(static_cast<int64_t>(block.size()), out.size() - begin);
    out.read(begin, count, block.data());
    for (int64_t i = 0; i < count; ++i)
      if (block[static_cast<size_t>(i)] >= out.vocab_size_)
        throw FormatError(concat(path, ": token ", block[static_cast<size_t>(i)], " at position ",
                                 begin + i, " is >= vocab_size ", out.vocab_size_,
                                 " (the data does not match its vocab_size attribute)"));
    counts.add(block.data(), static_cast<size_t>(count));
    hash.update(block.data(), static_cast<size_t>(count) * sizeof(uint32_t));
  }
  out.unigram_entropy_bits_ = counts.entropy_bits();
  out.checksum_ = hash.digest();
  return out;
}

TokenDataset TokenDataset::from_tokens(std::vector<uint32_t> tokens, int64_t vocab_size,
                                       std::string tokenizer, std::string source) {
  ST_CHECK_AS(ConfigError, vocab_size >= 1 && vocab_size <= kMaxVocab, source, ": vocab_size ",
              vocab_size, " is outside [1, 2^32]");
  for (size_t i = 0; i < tokens.size(); ++i)
    ST_CHECK_AS(ConfigError, tokens[i] < vocab_size, source, ": token ", tokens[i], " at position ",
                i, " is >= vocab_size ", vocab_size);
  TokenDataset out;
  out.source_ = std::move(source);
  out.vocab_size_ = vocab_size;
  out.tokenizer_ = std::move(tokenizer);
  out.unigram_entropy_bits_ = shardtrain::unigram_entropy_bits(tokens);
  WordHash hash;
  hash.update(tokens.data(), tokens.size() * sizeof(uint32_t));
  out.checksum_ = hash.digest();
  out.storage_ = tokens_in_memory(std::move(tokens));
  return out;
}

std::vector<uint32_t> TokenDataset::tokens() const {
  std::vector<uint32_t> all(static_cast<size_t>(size()));
  read(0, size(), all.data());
  return all;
}

bool names_text_corpus(const std::string& path) {
  if (path.size() <= 4) return false;
  std::string extension = path.substr(path.size() - 4);
  for (char& ch : extension) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return extension == ".txt";
}

TokenDataset load_token_source(const std::string& path) {
  if (path == "builtin") {
    ByteTokenizer tok;
    return TokenDataset::from_tokens(tok.encode(builtin_corpus()), tok.vocab_size(), tok.name(),
                                     "builtin corpus");
  }
  // The content decides, the name only confirms: a token dataset named .txt would otherwise be
  // trained on as the bytes of its HDF5 structure.
  std::error_code ec;
  if (!std::filesystem::exists(path, ec))
    throw ConfigError(concat(
        "data.path '", path, "' does not exist",
        std::filesystem::path(path).is_relative()
            ? concat(" (a relative path is taken from the working directory, ",
                     std::filesystem::current_path(ec).string(), ")")
            : std::string(),
        "; give builtin, a .txt file or a token dataset written by `shardtrain prepare-data`"));
  if (!std::filesystem::is_regular_file(path, ec))
    throw ConfigError(concat("data.path '", path, "' is not a regular file"));
  const bool named_text = names_text_corpus(path);
  if (h5::has_hdf5_signature(path)) {
    ST_CHECK_AS(ConfigError, !named_text, "data.path '", path,
                "' is named .txt but is an HDF5 file (a token dataset?): name token datasets .h5, "
                "and point data.path at the text itself to train on text");
    return TokenDataset::open(path);
  }
  if (!named_text) {
    // Renaming it .txt or converting it helps only if it is text: binary data (a raw token
    // array, an archive) holds NUL bytes, which neither accepts.
    std::ifstream head(path, std::ios::binary);
    std::string start(64 * 1024, '\0');
    head.read(start.data(), static_cast<std::streamsize>(start.size()));
    start.resize(static_cast<size_t>(std::max<std::streamsize>(0, head.gcount())));
    if (const size_t nul = start.find('\0'); nul != std::string::npos)
      throw ConfigError(concat(
          "data.path '", path, "' is neither an HDF5 token dataset nor text (a NUL byte at offset ",
          nul,
          ": binary data, such as a raw token array or an archive): give a token dataset "
          "written by `shardtrain prepare-data` from the text, or the text itself named .txt"));
    throw ConfigError(concat("data.path '", path,
                             "' is not an HDF5 token dataset: give a text file the .txt extension "
                             "(it is then trained on as bytes), or convert it with `shardtrain "
                             "prepare-data --input ",
                             path, " --output DATA.h5`"));
  }
  check_regular_file(path, "data.path");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError("data.path: cannot open '" + path + "'");
  std::stringstream text;
  text << in.rdbuf();
  const std::string bytes = text.str();
  // Text holds no NUL bytes; a binary file named .txt (a token array, an archive) does.
  if (const size_t nul = bytes.find('\0'); nul != std::string::npos)
    throw ConfigError(concat("data.path '", path, "' holds a NUL byte at offset ", nul,
                             ", so it is not text: a .txt file is trained on as bytes of text; "
                             "token arrays go in a token dataset (`shardtrain prepare-data`)"));
  ByteTokenizer tok;
  return TokenDataset::from_tokens(tok.encode(bytes), tok.vocab_size(), tok.name(), path);
}

}  // namespace shardtrain
