// Where a token dataset's tokens are read from. A dataset as `shardtrain prepare-data` writes it
// (uncompressed) is memory-mapped: a corpus larger than memory trains, the ranks of a node share
// one copy of it in the page cache, and opening it costs one pass over the file (validation)
// rather than a copy of every token into each process. The built-in corpus, text files and
// compressed datasets are held in memory as uint32.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shardtrain/core/hdf5.h"

namespace shardtrain {

class TokenStorage {
 public:
  virtual ~TokenStorage() = default;
  virtual int64_t size() const = 0;
  // Copies tokens [begin, begin + count) to `out`; the range must lie within [0, size()).
  virtual void read(int64_t begin, int64_t count, uint32_t* out) const = 0;
  // True when the tokens are read from the file through a memory mapping.
  virtual bool memory_mapped() const = 0;
};

std::shared_ptr<const TokenStorage> tokens_in_memory(std::vector<uint32_t> tokens);

// Maps the elements of `dataset` (1-D, uint16 or uint32, already validated as stored in its
// file) from the file that holds it. nullptr when its layout cannot be read as raw bytes
// (filtered chunks, big-endian elements): the caller reads it into memory instead. Throws
// FormatError when a block lies past the end of the file, Error when the file cannot be mapped.
std::shared_ptr<const TokenStorage> map_token_dataset(const h5::Dataset& dataset);

}  // namespace shardtrain
