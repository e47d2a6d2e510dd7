#include "shardtrain/core/dtype.h"

#include <cmath>

#include "shardtrain/core/error.h"

namespace shardtrain {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32:
      return 4;
    case DType::BF16:
      return 2;
    case DType::F16:
      return 2;
    case DType::I32:
      return 4;
    case DType::I64:
      return 8;
    case DType::U8:
      return 1;
  }
  return 0;
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32:
      return "f32";
    case DType::BF16:
      return "bf16";
    case DType::F16:
      return "f16";
    case DType::I32:
      return "i32";
    case DType::I64:
      return "i64";
    case DType::U8:
      return "u8";
  }
  return "?";
}

DType dtype_from_name(std::string_view n) {
  if (n == "f32" || n == "fp32" || n == "float32" || n == "F32") return DType::F32;
  if (n == "bf16" || n == "bfloat16" || n == "BF16") return DType::BF16;
  if (n == "f16" || n == "fp16" || n == "float16" || n == "F16") return DType::F16;
  if (n == "i32" || n == "int32" || n == "I32") return DType::I32;
  if (n == "i64" || n == "int64" || n == "I64") return DType::I64;
  if (n == "u8" || n == "uint8" || n == "U8") return DType::U8;
  throw ConfigError(detail::concat("unknown dtype '", n,
                                   "': expected one of fp32, bf16, fp16, int32, int64, uint8"));
}

bool is_floating(DType t) {
  return t == DType::F32 || t == DType::BF16 || t == DType::F16;
}

uint16_t float_to_f16(float f) {
  uint32_t x = float_bits(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t abs = x & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));
  if (abs >= 0x477ff000u) {  // rounds to >= 65520: overflow to inf
    return static_cast<uint16_t>(sign | 0x7c00u);
  }
  if (abs < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero
    // Scale so the half subnormal unit (2^-24) becomes 1, then round to nearest even.
    float magnitude = bits_float(abs);
    float scaled = magnitude * 16777216.0f;  // 2^24, exact
    float rounded = std::nearbyint(scaled);  // default rounding mode: nearest even
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(rounded));
  }
  // Normal: rebias exponent (127 -> 15) and round the 23-bit mantissa to 10 bits, nearest even.
  uint32_t rounding = 0xfffu + ((abs >> 13) & 1u);
  uint32_t h = (abs + rounding - (112u << 23)) >> 13;
  return static_cast<uint16_t>(sign | h);
}

float f16_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));  // inf / nan
  if (exp == 0) {
    float v = static_cast<float>(mant) * 5.9604644775390625e-8f;  // mant * 2^-24, exact
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

}  // namespace shardtrain
