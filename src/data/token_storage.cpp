#include "shardtrain/data/token_storage.h"

#include <sys/mman.h>

#include <algorithm>
#include <bit>
#include <boost/iostreams/device/mapped_file.hpp>
#include <cstring>
#include <filesystem>

#include "shardtrain/core/error.h"

namespace shardtrain {

using detail::concat;

namespace {

class InMemoryTokens : public TokenStorage {
 public:
  explicit InMemoryTokens(std::vector<uint32_t> tokens) : tokens_(std::move(tokens)) {}
  int64_t size() const override { return static_cast<int64_t>(tokens_.size()); }
  void read(int64_t begin, int64_t count, uint32_t* out) const override {
    std::copy_n(tokens_.data() + begin, count, out);
  }
  bool memory_mapped() const override { return false; }

 private:
  std::vector<uint32_t> tokens_;
};

// A read-only mapping of a whole file (Boost.Iostreams), advised for random access.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path) {
    std::error_code ec;
    const std::uintmax_t bytes = std::filesystem::file_size(path, ec);
    if (ec) throw Error(concat("cannot read the size of '", path, "': ", ec.message()));
    if (bytes == 0) return;  // nothing to map (an empty mapping is refused)
    try {
      file_.open(path);
    } catch (const std::exception& e) {
      throw Error(concat("cannot map '", path, "': ", e.what()));
    }
    // Windows are read at random: no read-ahead past the pages a window touches.
    ::madvise(const_cast<char*>(file_.data()), file_.size(), MADV_RANDOM);
  }

  const unsigned char* data() const {
    return file_.is_open() ? reinterpret_cast<const unsigned char*>(file_.data()) : nullptr;
  }
  size_t size() const { return file_.is_open() ? file_.size() : 0; }

 private:
  boost::iostreams::mapped_file_source file_;
};

// Little-endian uint16 or uint32 elements in blocks of a mapped file, copied as they are.
static_assert(std::endian::native == std::endian::little,
              "mapped token datasets are read as little-endian host integers");
class MappedTokens : public TokenStorage {
 public:
  MappedTokens(const std::string& path, std::vector<h5::Dataset::RawBlock> blocks,
               int64_t element_bytes)
      : file_(path), blocks_(std::move(blocks)), element_bytes_(element_bytes) {
    for (const h5::Dataset::RawBlock& b : blocks_) {
      const int64_t end = b.file_offset + b.num_elements * element_bytes_;
      if (b.file_offset < 0 || end > static_cast<int64_t>(file_.size()))
        throw FormatError(concat(path, ": the tokens from element ", b.first_element,
                                 " lie at bytes [", b.file_offset, ", ", end,
                                 ") but the file holds ", file_.size(), " (truncated?)"));
    }
    size_ = blocks_.empty() ? 0 : blocks_.back().first_element + blocks_.back().num_elements;
  }
  int64_t size() const override { return size_; }
  bool memory_mapped() const override { return true; }

  void read(int64_t begin, int64_t count, uint32_t* out) const override {
    // The block holding `begin`: the last one that starts at or before it.
    auto it = std::upper_bound(
        blocks_.begin(), blocks_.end(), begin,
        [](int64_t element, const h5::Dataset::RawBlock& b) { return element < b.first_element; });
    --it;
    while (count > 0) {
      const int64_t offset = begin - it->first_element;
      const int64_t take = std::min(count, it->num_elements - offset);
      const unsigned char* src = file_.data() + it->file_offset + offset * element_bytes_;
      if (element_bytes_ == 2) {
        for (int64_t i = 0; i < take; ++i) {
          uint16_t v;
          std::memcpy(&v, src + 2 * i, 2);
          out[i] = v;
        }
      } else {
        std::memcpy(out, src, static_cast<size_t>(take) * 4);
      }
      out += take;
      begin += take;
      count -= take;
      ++it;
    }
  }

 private:
  MappedFile file_;
  std::vector<h5::Dataset::RawBlock> blocks_;
  int64_t element_bytes_;
  int64_t size_ = 0;
};

}  // namespace

std::shared_ptr<const TokenStorage> tokens_in_memory(std::vector<uint32_t> tokens) {
  return std::make_shared<InMemoryTokens>(std::move(tokens));
}

std::shared_ptr<const TokenStorage> map_token_dataset(const h5::Dataset& dataset) {
  std::optional<std::vector<h5::Dataset::RawBlock>> blocks = dataset.raw_blocks();
  if (!blocks) return nullptr;
  const auto element_bytes = static_cast<int64_t>(dataset.type().size);
  return std::make_shared<MappedTokens>(dataset.file_name(), std::move(*blocks), element_bytes);
}

}  // namespace shardtrain
