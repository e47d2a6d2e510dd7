// WordHash: FNV-1a over 64-bit little-endian words, fed in pieces of any size (a trailing partial
// word is zero-padded). Fast enough to hash checkpoint files as they are written; it detects
// damage and mix-ups, and is not a cryptographic hash.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace shardtrain {

class WordHash {
 public:
  void update(const void* data, size_t bytes) {
    const auto* p = static_cast<const unsigned char*>(data);
    while (bytes > 0) {
      const size_t take = std::min(bytes, sizeof(uint64_t) - fill_);
      std::memcpy(reinterpret_cast<unsigned char*>(&word_) + fill_, p, take);
      fill_ += take;
      p += take;
      bytes -= take;
      if (fill_ == sizeof(uint64_t)) flush();
    }
  }
  // Hashes the value's bytes (an integer, say).
  template <typename T>
  void update_value(const T& value) {
    update(&value, sizeof value);
  }
  uint64_t digest() {
    if (fill_ > 0) flush();
    return hash_;
  }

 private:
  void flush() {
    hash_ = (hash_ ^ word_) * 0x100000001b3ull;
    word_ = 0;
    fill_ = 0;
  }
  uint64_t hash_ = 0xcbf29ce484222325ull;
  uint64_t word_ = 0;
  size_t fill_ = 0;
};

}  // namespace shardtrain
