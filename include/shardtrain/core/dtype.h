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

// `a` where `take_a`, else `b`, as bit masks: a conditional would let the compiler move each
// side's float arithmetic under a branch (it may not execute it speculatively), and a loop with
// branches does not vectorize.
inline uint32_t select_bits(bool take_a, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(take_a);
  return (a & mask) | (b & ~mask);
}

// Branch-free, so that loops over arrays vectorize (fp16 tensors on the CPU backend are
// converted element by element on every load and store). Each case is computed and the right one
// selected; the float arithmetic is exact or rounds exactly as the format requires.
inline uint16_t float_to_f16(float f) {
  const uint32_t x = float_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  // Normal halves: rebias the exponent (127 -> 15) and round the 23-bit mantissa to 10 bits,
  // nearest even. Wraps for small inputs, whose result is not selected.
  const uint32_t normal = (abs + 0xfffu + ((abs >> 13) & 1u) - (112u << 23)) >> 13;
  // Below 2^-14 (subnormal halves and zero): adding 0.5, whose float ulp is the half subnormal
  // unit 2^-24, makes the FPU round the magnitude to a whole number of units, nearest even, and
  // leaves that number in the sum's low mantissa bits. 2^-14 itself comes out as 0x400.
  const uint32_t subnormal = float_bits(bits_float(abs) + 0.5f) - 0x3f000000u;
  uint32_t h = select_bits(abs < 0x38800000u, subnormal, normal);
  h = select_bits(abs >= 0x477ff000u, 0x7c00u, h);  // rounds to >= 65520: infinity
  h = select_bits(abs > 0x7f800000u, 0x7e00u | ((abs >> 13) & 0x3ffu), h);  // NaN: quiet
  return static_cast<uint16_t>(sign | h);
}

inline float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t rest = h & 0x7fffu;
  // Placing the exponent and mantissa in a float's low bits and multiplying by 2^112 rebias the
  // exponent (15 -> 127) exactly, and turns a subnormal half (read as a subnormal float) into the
  // normal float of the same value.
  const uint32_t finite = float_bits(bits_float(rest << 13) * 0x1p112f);
  const uint32_t special = 0x7f800000u | (rest << 13);  // infinity, or NaN keeping its payload
  return bits_float(sign | select_bits(rest >= 0x7c00u, special, finite));
}

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
