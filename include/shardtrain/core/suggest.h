// "Did you mean ...?" for mistyped names (config keys, subcommands, flags, enum values).
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace shardtrain {

// Levenshtein distance: the fewest single-character insertions, deletions and substitutions that
// turn `a` into `b`.
size_t edit_distance(std::string_view a, std::string_view b);

// The candidate closest to `word` by edit distance, or "" when none is close enough to be a
// plausible typo (distance above max(2, word.size() / 3)). Ties go to the earlier candidate.
std::string closest_match(std::string_view word, const std::vector<std::string>& candidates);

}  // namespace shardtrain
