// Token datasets: a token stream stored in HDF5 as a 1-D dataset `tokens` (uint16 when the
// vocabulary fits, else uint32) with attributes `vocab_size` (int64) and `tokenizer` (string).
// Every token must be stored in the file that holds the dataset (compressed or not, reached
// through an external link or not): a virtual dataset, external raw storage, or storage never
// allocated is refused, since HDF5 would read its missing elements as zeros. Storage allocated
// but never written (early allocation, then a writer that stopped) reads as zeros too, and the
// file cannot tell: the trainer warns when the tokens are nearly all one value.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shardtrain/core/hdf5.h"
#include "shardtrain/data/token_storage.h"

namespace shardtrain {

// Streams tokens into a new token dataset. The file is built under `path.tmp.<pid>` and renamed
// over `path` only by commit(), so an interrupted write never leaves a partial dataset behind.
// `expected_tokens` (a guess; 0 = small) sizes the chunks the tokens are stored in.
class TokenDatasetWriter {
 public:
  TokenDatasetWriter(const std::string& path, int64_t vocab_size, const std::string& tokenizer,
                     int64_t expected_tokens = 0);
  ~TokenDatasetWriter();
  TokenDatasetWriter(const TokenDatasetWriter&) = delete;
  TokenDatasetWriter& operator=(const TokenDatasetWriter&) = delete;

  // Throws ConfigError naming the position of a token >= vocab_size.
  void append(const uint32_t* tokens, size_t count);
  void append(const std::vector<uint32_t>& tokens) { append(tokens.data(), tokens.size()); }
  int64_t size() const { return size_; }
  void commit();

 private:
  std::string path_;
  std::string tmp_path_;
  int64_t vocab_size_;
  bool narrow_;  // stored as uint16
  int64_t size_ = 0;
  std::unique_ptr<h5::File> file_;
  std::unique_ptr<h5::Dataset> dataset_;
  bool committed_ = false;
};

// Writes a whole token stream at once (atomically, as TokenDatasetWriter).
void write_token_dataset(const std::string& path, const std::vector<uint32_t>& tokens,
                         int64_t vocab_size, const std::string& tokenizer);

// A token stream: memory-mapped from its file or held in memory (data/token_storage.h), shared
// cheaply between copies and samplers.
class TokenDataset {
 public:
  // Opens and validates a token dataset, mapping its tokens when they are stored uncompressed;
  // throws ConfigError when the file is missing and FormatError (naming the file and the
  // problem) when it is not a valid token dataset, including any token >= vocab_size (one pass
  // over the tokens, which also counts them for unigram_entropy_bits and hashes them for
  // checksum).
  static TokenDataset open(const std::string& path);
  // A dataset over tokens already in memory; `source` names it in messages.
  static TokenDataset from_tokens(std::vector<uint32_t> tokens, int64_t vocab_size,
                                  std::string tokenizer, std::string source = "<memory>");

  const std::string& source() const { return source_; }
  int64_t vocab_size() const { return vocab_size_; }
  const std::string& tokenizer() const { return tokenizer_; }  // "" when the file names none
  int64_t size() const { return storage_->size(); }
  // Copies tokens [begin, begin + count), which must lie within [0, size()), to `out`.
  void read(int64_t begin, int64_t count, uint32_t* out) const {
    storage_->read(begin, count, out);
  }
  // Every token, copied (for tests and small datasets).
  std::vector<uint32_t> tokens() const;
  bool memory_mapped() const { return storage_->memory_mapped(); }
  // Why uncompressed tokens of a file are held in memory instead of mapped, with what would let
  // them be mapped ("" when mapped, compressed, or not from a file).
  const std::string& why_not_mapped() const { return why_not_mapped_; }
  // Entropy of the tokens' unigram distribution, bits per token: the loss of a model that
  // learned only token frequencies (a baseline for the training loss).
  double unigram_entropy_bits() const { return unigram_entropy_bits_; }
  // WordHash of every token as uint32, taken in the same pass: tells two streams apart (the
  // ranks of a job compare it, so that none trains on a different copy of the data).
  uint64_t checksum() const { return checksum_; }

  // A memory-mapped dataset reads its file's pages as the run goes: a file written over in place
  // (cp onto it, truncate) changes the tokens under the run, or ends it with SIGBUS. What changed
  // since open() ("" when nothing did): the file's size or modification time, with the same
  // inode. Another file renamed onto the path (what prepare-data does) or a deleted one is no
  // change: the mapping keeps the file it opened. Always "" for tokens held in memory.
  std::string changed_on_disk() const;

 private:
  struct FileStamp {
    uint64_t device = 0, inode = 0;
    int64_t size = -1, modified_ns = 0;
  };
  static FileStamp stamp_of(const std::string& path);
  FileStamp opened_;         // of the file open() mapped
  std::string mapped_path_;  // that file: source_, or the target of an external link
  std::string source_;
  int64_t vocab_size_ = 0;
  std::string tokenizer_;
  std::shared_ptr<const TokenStorage> storage_;
  std::string why_not_mapped_;
  double unigram_entropy_bits_ = 0;
  uint64_t checksum_ = 0;
};

// The token stream a run's `data.path` names: "builtin" (the embedded corpus), a .txt file
// (tokenized as bytes) or a token dataset written by `shardtrain prepare-data` (.h5, or any name
// but .txt). The content decides, by HDF5's signature; ConfigError when the name disagrees (a
// dataset named .txt, text under another name) or a .txt file holds NUL bytes (not text).
TokenDataset load_token_source(const std::string& path);
// Whether `data.path` names a text corpus (a .txt file: read whole, held in memory as tokens).
bool names_text_corpus(const std::string& path);

}  // namespace shardtrain
