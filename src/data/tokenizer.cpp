#include "shardtrain/data/tokenizer.h"

#include "shardtrain/core/error.h"

namespace shardtrain {

std::vector<uint32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<uint32_t> out(text.size());
  for (size_t i = 0; i < text.size(); ++i) out[i] = static_cast<unsigned char>(text[i]);
  return out;
}

std::string ByteTokenizer::decode(const std::vector<uint32_t>& tokens) const {
  std::string out(tokens.size(), '\0');
  for (size_t i = 0; i < tokens.size(); ++i) {
    ST_CHECK_AS(ConfigError, tokens[i] < kVocabSize, "byte tokenizer: token ", tokens[i],
                " at position ", i, " is outside the vocabulary of ", kVocabSize);
    out[i] = static_cast<char>(tokens[i]);
  }
  return out;
}

std::unique_ptr<Tokenizer> make_tokenizer(const std::string& name) {
  if (name == "byte") return std::make_unique<ByteTokenizer>();
  throw ConfigError("unknown tokenizer '" + name + "': supported tokenizers: byte");
}

}  // namespace shardtrain
