// Element types and exact conversions between them.
#pragma once
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace shardtrain {

enum class DType : uint8_t { F32, BF16, F16, I32, I64, U8 };

size_t dtype_size(DType t);
std::string_view dtype_name(DType t);  // "f32", "bf16", ...
DType dtype_from_name(
    std::string_view name);  // accepts "f32"/"fp32"/"float32", ...; throws ConfigError
bool is_floating(DType t);

// IEEE half and bfloat16 bit patterns; float<->half conversions round to nearest even and keep
// NaN (quiet) and +-Inf.
inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN
  uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}
inline float bf16_to_float(uint16_t h) {
  return bits_float(static_cast<uint32_t>(h) << 16);
}

uint16_t float_to_f16(float f);
float f16_to_float(uint16_t h);

// Rounds a float through a 16-bit type and back (what storing in that dtype does to a value).
inline float round_to(DType t, float f);

struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};

}  // namespace shardtrain

inline float shardtrain::round_to(DType t, float f) {
  if (t == DType::BF16) return bf16_to_float(float_to_bf16(f));
  if (t == DType::F16) return f16_to_float(float_to_f16(f));
  return f;
}
