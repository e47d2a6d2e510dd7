// Byte sizes as people read and write them ("1.5 GiB", "80GiB", "512MB").
#pragma once
#include <cstdint>
#include <string>

namespace shardtrain {

std::string format_bytes(int64_t bytes);       // "1.50 GiB"
int64_t parse_bytes(const std::string& text);  // "80GiB", "512MB", "1024"; throws ConfigError

}  // namespace shardtrain
