// Byte sizes as people read and write them ("1.5 GiB", "80GiB", "512MB"), and rates.
#pragma once
#include <cstdint>
#include <string>

namespace shardtrain {

std::string format_bytes(int64_t bytes);       // "1.50 GiB"
int64_t parse_bytes(const std::string& text);  // "80GiB", "512MB", "1024"; throws ConfigError
// A rate such as tokens per second: whole above 100 ("12345"), else three significant digits
// ("45.3", "0.812"), so a slow step (a large model on a CPU) does not read as 0.
std::string format_rate(double per_second);

}  // namespace shardtrain
