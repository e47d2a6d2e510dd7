#include "shardtrain/data/corpus.h"

#include <array>
#include <cctype>
#include <cmath>
#include <map>

#include "shardtrain/core/error.h"
#include "shardtrain/data/splitmix.h"

namespace shardtrain {

namespace {

struct Noun {
  const char* singular;
  const char* plural;
  bool animal;  // singular pronoun "it"; people nouns are repeated instead
};

struct Name {
  const char* text;
  const char* pronoun;  // "he" / "she"
};

struct Verb {
  const char* third_person;  // "sleeps"
  const char* base;          // "sleep"
};

constexpr Noun kAgents[] = {
    {"cat", "cats", true},          {"dog", "dogs", true},          {"fox", "foxes", true},
    {"mouse", "mice", true},        {"horse", "horses", true},      {"bird", "birds", true},
    {"wolf", "wolves", true},       {"goose", "geese", true},       {"farmer", "farmers", false},
    {"child", "children", false},   {"teacher", "teachers", false}, {"baker", "bakers", false},
    {"sailor", "sailors", false},   {"doctor", "doctors", false},   {"woman", "women", false},
    {"man", "men", false},          {"king", "kings", false},       {"queen", "queens", false},
    {"student", "students", false}, {"painter", "painters", false},
};

constexpr Name kNames[] = {
    {"Anna", "she"}, {"Tom", "he"}, {"Mira", "she"}, {"Leo", "he"},
    {"Sara", "she"}, {"Ben", "he"}, {"Nina", "she"}, {"Omar", "he"},
};

constexpr const char* kAgentAdjectives[] = {"old",    "young", "small", "big",    "happy",  "tired",
                                            "clever", "quiet", "brave", "hungry", "little", "kind"};

constexpr Noun kThings[] = {
    {"apple", "apples", false},   {"book", "books", false},     {"box", "boxes", false},
    {"loaf", "loaves", false},    {"cup", "cups", false},       {"stone", "stones", false},
    {"letter", "letters", false}, {"key", "keys", false},       {"coin", "coins", false},
    {"basket", "baskets", false}, {"candle", "candles", false}, {"shoe", "shoes", false},
    {"egg", "eggs", false},       {"flower", "flowers", false},
};

constexpr const char* kThingAdjectives[] = {"red",   "heavy", "shiny", "old",
                                            "green", "warm",  "tiny",  "blue"};

constexpr const char* kPlaces[] = {"garden",  "kitchen", "market",  "forest", "river", "school",
                                   "village", "castle",  "library", "harbor", "field", "bakery"};

constexpr const char* kPrepositions[] = {"in", "near", "behind", "beside"};

constexpr Verb kIntransitive[] = {
    {"sleeps", "sleep"}, {"runs", "run"},   {"sings", "sing"}, {"waits", "wait"},
    {"works", "work"},   {"plays", "play"}, {"reads", "read"}, {"dances", "dance"},
    {"rests", "rest"},   {"walks", "walk"},
};

constexpr Verb kTransitive[] = {
    {"sees", "see"},      {"finds", "find"},   {"carries", "carry"}, {"likes", "like"},
    {"watches", "watch"}, {"paints", "paint"}, {"buys", "buy"},      {"drops", "drop"},
};

constexpr const char* kTimes[] = {"in the morning", "at night",  "every day",   "in the evening",
                                  "after lunch",    "on Monday", "on Tuesday",  "on Wednesday",
                                  "on Thursday",    "on Friday", "on Saturday", "on Sunday"};

constexpr const char* kAdverbs[] = {"slowly", "quickly", "happily", "quietly", "often"};

constexpr const char* kUnits[] = {"zero",    "one",     "two",       "three",    "four",
                                  "five",    "six",     "seven",     "eight",    "nine",
                                  "ten",     "eleven",  "twelve",    "thirteen", "fourteen",
                                  "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"};
constexpr const char* kTens[] = {"",      "",      "twenty",  "thirty", "forty",
                                 "fifty", "sixty", "seventy", "eighty", "ninety"};

template <typename T, size_t N>
const T& pick(SplitMix64& rng, const T (&items)[N]) {
  return items[rng.below(N)];
}

// The subject a paragraph is about.
struct Subject {
  std::string phrase;   // "the old farmer", "the cats", "Anna"
  std::string pronoun;  // "it", "they", "he", "she", or "" (repeat the phrase)
  bool plural = false;
};

// Writes one paragraph at a time into `out`; remembers facts stated in the paragraph so that
// questions later in it can be answered from context.
class ParagraphWriter {
 public:
  ParagraphWriter(SplitMix64& rng, std::string& out) : rng_(rng), out_(out) {}

  void paragraph() {
    if (rng_.chance(0.25)) {
      math_paragraph();
    } else {
      story_paragraph();
    }
    out_ += "\n\n";
  }

 private:
  void sentence(std::string text) {
    text[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(text[0])));
    if (!first_in_paragraph_) out_ += ' ';
    out_ += text;
    first_in_paragraph_ = false;
  }

  Subject make_subject() {
    Subject s;
    if (rng_.chance(0.3)) {
      const Name& n = pick(rng_, kNames);
      s.phrase = n.text;
      s.pronoun = n.pronoun;
      return s;
    }
    const Noun& noun = pick(rng_, kAgents);
    s.plural = rng_.chance(0.35);
    s.phrase = "the ";
    if (rng_.chance(0.5)) s.phrase += std::string(pick(rng_, kAgentAdjectives)) + " ";
    s.phrase += s.plural ? noun.plural : noun.singular;
    s.pronoun = s.plural ? "they" : (noun.animal ? "it" : "");
    return s;
  }

  // The subject as the sentence opener: the phrase the first time, later often a pronoun.
  std::string subject_ref() {
    if (mentioned_ && !subject_.pronoun.empty() && rng_.chance(0.5)) return subject_.pronoun;
    mentioned_ = true;
    return subject_.phrase;
  }

  const char* agree(const Verb& v) const { return subject_.plural ? v.base : v.third_person; }
  const char* be() const { return subject_.plural ? "are" : "is"; }
  const char* have() const { return subject_.plural ? "have" : "has"; }

  std::string counted(int n, const Noun& thing) {
    return number_word(n) + " " + (n == 1 ? thing.singular : thing.plural);
  }

  void story_paragraph() {
    subject_ = make_subject();
    mentioned_ = false;
    first_in_paragraph_ = true;
    has_place_ = false;
    has_count_ = false;
    const int sentences = 3 + static_cast<int>(rng_.below(4));
    for (int i = 0; i < sentences; ++i) {
      switch (rng_.below(7)) {
        case 0:
        case 1:
          place_sentence();
          break;
        case 2:
          object_sentence();
          break;
        case 3:
          count_sentence();
          break;
        case 4:
          sentence(subject_ref() + " " + be() + " " + pick(rng_, kAgentAdjectives) + ".");
          break;
        case 5:
          if (has_place_)
            where_question();
          else
            place_sentence();
          break;
        case 6:
          if (has_count_)
            how_many_question();
          else
            count_sentence();
          break;
      }
    }
  }

  void place_sentence() {
    place_ = pick(rng_, kPlaces);
    preposition_ = pick(rng_, kPrepositions);
    has_place_ = true;
    std::string s = subject_ref() + " " + agree(pick(rng_, kIntransitive));
    if (rng_.chance(0.3)) s += std::string(" ") + pick(rng_, kAdverbs);
    s += " " + preposition_ + " the " + place_;
    if (rng_.chance(0.4)) s += std::string(" ") + pick(rng_, kTimes);
    sentence(s + ".");
  }

  void object_sentence() {
    const Noun& thing = pick(rng_, kThings);
    std::string object;
    if (rng_.chance(0.4)) {
      object = counted(2 + static_cast<int>(rng_.below(11)), thing);
    } else {
      object = "the ";
      if (rng_.chance(0.6)) object += std::string(pick(rng_, kThingAdjectives)) + " ";
      object += thing.singular;
    }
    sentence(subject_ref() + " " + agree(pick(rng_, kTransitive)) + " " + object + ".");
  }

  void count_sentence() {
    count_thing_ = &pick(rng_, kThings);
    count_ = 1 + static_cast<int>(rng_.below(20));
    has_count_ = true;
    sentence(subject_ref() + " " + have() + " " + counted(count_, *count_thing_) + ".");
  }

  void where_question() {
    // The answer repeats the place stated earlier in the paragraph.
    sentence(std::string("where ") + be() + " " + subject_.phrase + "?");
    sentence(subject_.phrase + " " + be() + " " + preposition_ + " the " + place_ + ".");
  }

  void how_many_question() {
    sentence(std::string("how many ") + count_thing_->plural + " " +
             (subject_.plural ? "do " : "does ") + subject_.phrase + " have?");
    sentence(subject_.phrase + " " + have() + " " + number_word(count_) + ".");
  }

  void math_paragraph() {
    first_in_paragraph_ = true;
    const int sentences = 3 + static_cast<int>(rng_.below(5));
    for (int i = 0; i < sentences; ++i) {
      switch (rng_.below(4)) {
        case 0: {
          int a = static_cast<int>(rng_.below(50)), b = static_cast<int>(rng_.below(50));
          sentence(number_word(a) + " plus " + number_word(b) + " is " + number_word(a + b) + ".");
          break;
        }
        case 1: {
          int a = static_cast<int>(rng_.below(100)), b = static_cast<int>(rng_.below(100));
          if (b > a) std::swap(a, b);
          sentence(number_word(a) + " minus " + number_word(b) + " is " + number_word(a - b) + ".");
          break;
        }
        case 2: {
          int a = 1 + static_cast<int>(rng_.below(10)), b = 1 + static_cast<int>(rng_.below(10));
          sentence(number_word(a) + " times " + number_word(b) + " is " + number_word(a * b) + ".");
          break;
        }
        case 3: {
          int start = static_cast<int>(rng_.below(90));
          int length = 3 + static_cast<int>(rng_.below(5));
          std::string s = "counting:";
          for (int k = 0; k < length; ++k) s += (k == 0 ? " " : ", ") + number_word(start + k);
          sentence(s + ".");
          break;
        }
      }
    }
  }

  SplitMix64& rng_;
  std::string& out_;
  Subject subject_;
  bool mentioned_ = false;
  bool first_in_paragraph_ = true;
  bool has_place_ = false;
  std::string place_;
  std::string preposition_;
  bool has_count_ = false;
  const Noun* count_thing_ = nullptr;
  int count_ = 0;
};

}  // namespace

std::string number_word(int n) {
  ST_CHECK_AS(ConfigError, n >= 0 && n <= 999, "number_word: ", n, " is outside [0, 999]");
  if (n < 20) return kUnits[n];
  if (n < 100)
    return n % 10 == 0 ? kTens[n / 10] : std::string(kTens[n / 10]) + "-" + kUnits[n % 10];
  std::string out = std::string(kUnits[n / 100]) + " hundred";
  if (n % 100 != 0) out += " and " + number_word(n % 100);
  return out;
}

std::string generate_corpus(int64_t size_bytes, uint64_t seed) {
  ST_CHECK_AS(ConfigError, size_bytes >= 0, "corpus size must be non-negative, got ", size_bytes);
  SplitMix64 rng(seed);
  std::string out;
  out.reserve(static_cast<size_t>(size_bytes) + 1024);
  ParagraphWriter writer(rng, out);
  while (static_cast<int64_t>(out.size()) < size_bytes) writer.paragraph();
  out.resize(static_cast<size_t>(size_bytes));
  return out;
}

std::string builtin_corpus() {
  return generate_corpus(kBuiltinCorpusBytes, kBuiltinCorpusSeed);
}

void TokenCounts::add(const uint32_t* tokens, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    const uint32_t t = tokens[i];
    if (t < dense_.size())
      ++dense_[t];
    else
      ++sparse_[t];
  }
  total_ += static_cast<int64_t>(count);
}

double TokenCounts::entropy_bits() const {
  if (total_ == 0) return 0.0;
  const double n = static_cast<double>(total_);
  double bits = 0.0;
  auto add_term = [&](int64_t count) {
    const double p = static_cast<double>(count) / n;
    bits -= p * std::log2(p);
  };
  for (int64_t count : dense_)
    if (count > 0) add_term(count);
  for (const auto& entry : sparse_) add_term(entry.second);
  return bits;
}

double unigram_entropy_bits(const std::vector<uint32_t>& tokens) {
  TokenCounts counts;
  counts.add(tokens);
  return counts.entropy_bits();
}

}  // namespace shardtrain
