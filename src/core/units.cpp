#include "shardtrain/core/units.h"

#include <fmt/format.h>
#include <cctype>
#include <cmath>
#include <cstdio>

#include "shardtrain/core/error.h"

namespace shardtrain {

std::string format_bytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (std::fabs(v) >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  if (u == 0) return fmt::format("{} B", bytes);
  return fmt::format("{:.2f} {}", v, units[u]);
}

std::string format_rate(double per_second) {
  if (!(std::fabs(per_second) < 100.0)) return fmt::format("{:.0f}", per_second);
  return fmt::format("{:.3g}", per_second);
}

int64_t parse_bytes(const std::string& text) {
  size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.'))
    ++i;
  std::string number = text.substr(0, i);
  std::string unit = text.substr(i);
  while (!unit.empty() && unit.front() == ' ') unit.erase(0, 1);
  double v = 0;
  try {
    size_t used = 0;
    v = std::stod(number, &used);
    if (used != number.size()) throw std::invalid_argument("x");
  } catch (const std::exception&) {
    throw ConfigError("cannot read '" + text + "' as a byte size: write e.g. 80GiB, 512MiB, 24GB");
  }
  double mult = 1;
  if (unit.empty() || unit == "B")
    mult = 1;
  else if (unit == "KiB" || unit == "K")
    mult = 1024.0;
  else if (unit == "MiB" || unit == "M")
    mult = 1024.0 * 1024;
  else if (unit == "GiB" || unit == "G")
    mult = 1024.0 * 1024 * 1024;
  else if (unit == "TiB" || unit == "T")
    mult = 1024.0 * 1024 * 1024 * 1024;
  else if (unit == "KB")
    mult = 1e3;
  else if (unit == "MB")
    mult = 1e6;
  else if (unit == "GB")
    mult = 1e9;
  else if (unit == "TB")
    mult = 1e12;
  else
    throw ConfigError("unknown byte unit '" + unit + "' in '" + text +
                      "': use B, KiB, MiB, GiB, TiB (or K, M, G, T: the same powers of 1024), "
                      "or KB, MB, GB, TB (powers of 1000)");
  // A fraction of a larger unit ("1.5GiB") is a size; a fraction of one byte is a mistake.
  if (mult == 1 && v != std::floor(v))
    throw ConfigError("byte size '" + text +
                      "' is not a whole number of bytes: write a whole number, or a fraction of "
                      "a larger unit (1.5GiB)");
  // 2^63 bytes and more do not fit the signed 64-bit sizes used everywhere.
  if (!(v * mult < 9223372036854775808.0))
    throw ConfigError("byte size '" + text + "' is too large (at most 8 EiB)");
  return static_cast<int64_t>(v * mult);
}

}  // namespace shardtrain
