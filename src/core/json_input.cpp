#include "shardtrain/core/json_input.h"

#include "shardtrain/core/error.h"

namespace shardtrain {

nlohmann::json parse_json_input(std::string_view text) {
  if (const size_t nul = text.find('\0'); nul != std::string_view::npos)
    throw FormatError("holds a NUL byte at offset " + std::to_string(nul) +
                      ": not a JSON text file");
  // The parser keeps its own stack (no recursion); the callback sees each value's depth.
  return nlohmann::json::parse(
      text.begin(), text.end(), [](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
        if (depth > kMaxJsonDepth)
          throw FormatError("JSON nested deeper than " + std::to_string(kMaxJsonDepth) +
                            " levels; no file this program reads nests more than a few");
        return true;
      });
}

}  // namespace shardtrain
