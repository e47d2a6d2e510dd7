// JSON read from files a user gives (config.json, adapter_config.json, safetensors headers and
// indexes). None of them nests more than a few levels; a value nested many thousands deep parses,
// but then overflows the stack wherever it is printed (an error message) or copied.
#pragma once
#include <nlohmann/json.hpp>
#include <string_view>

namespace shardtrain {

inline constexpr int kMaxJsonDepth = 64;

// nlohmann::json::parse of `text`; throws nlohmann::json::parse_error for malformed text, and
// FormatError for a NUL byte (the parser would take it for the end of the input and never read
// what follows) or nesting deeper than kMaxJsonDepth.
nlohmann::json parse_json_input(std::string_view text);

}  // namespace shardtrain
