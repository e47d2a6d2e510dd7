// The built-in training corpus: English-like text from a small probabilistic grammar.
//
// Sentences about a few dozen people, animals, things and places with subject-verb and
// number-noun agreement, numbers written as words, true arithmetic facts ("seven plus two is
// nine."), counting runs, and questions answered from earlier in the same paragraph. A byte-level
// model can learn much of this structure, so its loss falls well below the text's unigram byte
// entropy; the generator uses its own PRNG, so the text is identical on every platform.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace shardtrain {

constexpr int64_t kBuiltinCorpusBytes = 1310720;  // 1.25 MiB
constexpr uint64_t kBuiltinCorpusSeed = 1234;

// Exactly `size_bytes` bytes of ASCII text, fully determined by `seed`.
std::string generate_corpus(int64_t size_bytes, uint64_t seed);
// generate_corpus(kBuiltinCorpusBytes, kBuiltinCorpusSeed).
std::string builtin_corpus();

// "seven", "forty-two"; n in [0, 999].
std::string number_word(int n);

// Token frequencies, accumulated piece by piece, for the entropy figure.
class TokenCounts {
 public:
  void add(const uint32_t* tokens, size_t count);
  void add(const std::vector<uint32_t>& tokens) { add(tokens.data(), tokens.size()); }
  // Shannon entropy of the frequencies, in bits per token: what a model that ignores context
  // would reach at best. Summed in token order, so the same on every platform.
  double entropy_bits() const;

 private:
  std::vector<int64_t> dense_ = std::vector<int64_t>(65536, 0);  // tokens below 2^16
  std::map<uint32_t, int64_t> sparse_;                           // the rest
  int64_t total_ = 0;
};

// TokenCounts of `tokens`, entropy_bits.
double unigram_entropy_bits(const std::vector<uint32_t>& tokens);

}  // namespace shardtrain
