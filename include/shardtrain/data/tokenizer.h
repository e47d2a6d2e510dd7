// Tokenizers: text <-> token ids.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace shardtrain {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::string name() const = 0;  // recorded in token datasets ("byte")
  virtual int64_t vocab_size() const = 0;
  virtual std::vector<uint32_t> encode(std::string_view text) const = 0;
  // Throws ConfigError for an id outside the vocabulary.
  virtual std::string decode(const std::vector<uint32_t>& tokens) const = 0;
};

// Every byte is its own token (vocab 256): no training, no unknown tokens, any input.
class ByteTokenizer : public Tokenizer {
 public:
  static constexpr int64_t kVocabSize = 256;
  std::string name() const override { return "byte"; }
  int64_t vocab_size() const override { return kVocabSize; }
  std::vector<uint32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<uint32_t>& tokens) const override;
};

// The tokenizer called `name`; throws ConfigError listing the known names otherwise.
std::unique_ptr<Tokenizer> make_tokenizer(const std::string& name);

}  // namespace shardtrain
