// bf16/f16 conversions: round-to-nearest-even on chosen values, exhaustive round trips, and a
// nearest-value check over a sweep of float bit patterns.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "shardtrain/core/dtype.h"
#include "shardtrain/core/error.h"

namespace shardtrain {
namespace {

float from_bits(uint32_t u) {
  return bits_float(u);
}

bool f16_is_nan(uint16_t h) {
  return (h & 0x7c00u) == 0x7c00u && (h & 0x03ffu) != 0;
}
bool bf16_is_nan(uint16_t h) {
  return (h & 0x7f80u) == 0x7f80u && (h & 0x007fu) != 0;
}

TEST(DType, SizesNamesAndParsing) {
  EXPECT_EQ(dtype_size(DType::F32), 4u);
  EXPECT_EQ(dtype_size(DType::BF16), 2u);
  EXPECT_EQ(dtype_size(DType::F16), 2u);
  EXPECT_EQ(dtype_size(DType::I64), 8u);
  EXPECT_EQ(dtype_from_name("bfloat16"), DType::BF16);
  EXPECT_EQ(dtype_from_name("fp16"), DType::F16);
  EXPECT_EQ(dtype_name(DType::I32), "i32");
  EXPECT_TRUE(is_floating(DType::BF16));
  EXPECT_FALSE(is_floating(DType::I64));
  try {
    dtype_from_name("float8");
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("float8"), std::string::npos);
  }
}

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16(-2.0f), 0xc000);
  // Ties: halfway between two bf16 values goes to the even mantissa.
  EXPECT_EQ(float_to_bf16(from_bits(0x3f808000u)), 0x3f80);  // 1 + 2^-8: even is 0x3f80
  EXPECT_EQ(float_to_bf16(from_bits(0x3f818000u)), 0x3f82);  // odd below: rounds up
  EXPECT_EQ(float_to_bf16(from_bits(0x3f808001u)), 0x3f81);  // just above the tie
  EXPECT_EQ(float_to_bf16(from_bits(0x3f807fffu)), 0x3f80);  // just below the tie
  // Subnormals round like any other value.
  EXPECT_EQ(float_to_bf16(from_bits(0x00008000u)), 0x0000);
  EXPECT_EQ(float_to_bf16(from_bits(0x00018000u)), 0x0002);
  EXPECT_EQ(float_to_bf16(from_bits(0x00010000u)), 0x0001);
  EXPECT_EQ(float_to_bf16(from_bits(0x80000001u)), 0x8000);
  // Overflow: the largest float rounds up to infinity, one below the tie stays finite.
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(float_to_bf16(from_bits(0x7f7f7fffu)), 0x7f7f);
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(float_to_bf16(-std::numeric_limits<float>::infinity()), 0xff80);
  // Signed zero and NaN (including NaNs whose payload lives only in the dropped bits).
  EXPECT_EQ(float_to_bf16(-0.0f), 0x8000);
  EXPECT_TRUE(bf16_is_nan(float_to_bf16(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(bf16_is_nan(float_to_bf16(from_bits(0x7f800001u))));
  EXPECT_TRUE(bf16_is_nan(float_to_bf16(from_bits(0xff800001u))));
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(from_bits(0x7f800001u)))));
  EXPECT_EQ(bf16_to_float(0x3f81), 1.0078125f);
}

TEST(DType, F16RoundsToNearestEven) {
  EXPECT_EQ(float_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(float_to_f16(-2.0f), 0xc000);
  EXPECT_EQ(float_to_f16(65504.0f), 0x7bff);
  // Ties in the normal range.
  EXPECT_EQ(float_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  EXPECT_EQ(float_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_EQ(float_to_f16(std::nextafter(1.0f + std::ldexp(1.0f, -11), 2.0f)), 0x3c01);
  // Overflow: 65520 is the tie between 65504 and 2^16 and goes to infinity.
  EXPECT_EQ(float_to_f16(65519.0f), 0x7bff);
  EXPECT_EQ(float_to_f16(65520.0f), 0x7c00);
  EXPECT_EQ(float_to_f16(-1e6f), 0xfc00);
  EXPECT_EQ(float_to_f16(std::numeric_limits<float>::infinity()), 0x7c00);
  // Subnormals: unit 2^-24.
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -25)), 0x0000);      // tie to even zero
  EXPECT_EQ(float_to_f16(3 * std::ldexp(1.0f, -25)), 0x0002);  // tie 1.5 units -> 2
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -26)), 0x0000);
  EXPECT_EQ(float_to_f16(1023 * std::ldexp(1.0f, -24)), 0x03ff);
  EXPECT_EQ(float_to_f16(1023.5f * std::ldexp(1.0f, -24)), 0x0400);  // tie into the normals
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -14)), 0x0400);
  EXPECT_EQ(float_to_f16(-1e-10f), 0x8000);
  EXPECT_EQ(f16_to_float(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(f16_to_float(0x03ff), 1023 * std::ldexp(1.0f, -24));
  // Signed zero and NaN.
  EXPECT_EQ(float_to_f16(-0.0f), 0x8000);
  EXPECT_TRUE(std::signbit(f16_to_float(0x8000)));
  EXPECT_TRUE(f16_is_nan(float_to_f16(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(f16_is_nan(float_to_f16(from_bits(0x7f800001u))));  // payload below f16 precision
  EXPECT_TRUE(f16_is_nan(float_to_f16(from_bits(0xffc00000u))));
  EXPECT_TRUE(std::isnan(f16_to_float(0x7e00)));
}

TEST(DType, F16RoundTripsEveryBitPattern) {
  int checked = 0;
  for (uint32_t h = 0; h <= 0xffffu; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    const float f = f16_to_float(bits);
    if (f16_is_nan(bits)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << h;
      ASSERT_TRUE(f16_is_nan(float_to_f16(f))) << std::hex << h;
      continue;
    }
    ASSERT_EQ(float_to_f16(f), bits) << "f16 0x" << std::hex << h << " -> " << f;
    ++checked;
  }
  EXPECT_EQ(checked, 65536 - 2 * 1023);
}

TEST(DType, Bf16RoundTripsEveryBitPattern) {
  int checked = 0;
  for (uint32_t h = 0; h <= 0xffffu; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    const float f = bf16_to_float(bits);
    if (bf16_is_nan(bits)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << h;
      ASSERT_TRUE(bf16_is_nan(float_to_bf16(f))) << std::hex << h;
      continue;
    }
    ASSERT_EQ(float_to_bf16(f), bits) << "bf16 0x" << std::hex << h << " -> " << f;
    ++checked;
  }
  EXPECT_EQ(checked, 65536 - 2 * 127);
}

// For a finite input, the chosen 16-bit value must be at least as close as both neighbours, and
// on a tie the mantissa must be even. `decode` maps a magnitude bit pattern to its value.
template <typename Decode>
void expect_nearest_even(float f, uint16_t got, uint16_t inf_bits, Decode decode) {
  const uint16_t mag = got & 0x7fffu;
  const double x = std::fabs(static_cast<double>(f));
  ASSERT_EQ((got & 0x8000u) != 0, std::signbit(f)) << f;
  if (mag == inf_bits) {
    // Overflowed: the input is at least halfway between the largest finite value and the next
    // power of two the format would reach.
    const double largest = decode(static_cast<uint16_t>(inf_bits - 1));
    const double ulp = largest - decode(static_cast<uint16_t>(inf_bits - 2));
    ASSERT_GE(x, largest + ulp / 2) << f;
    return;
  }
  const double here = std::fabs(x - decode(mag));
  if (mag > 0) {
    const double below = std::fabs(x - decode(static_cast<uint16_t>(mag - 1)));
    ASSERT_TRUE(here < below || (here == below && (mag & 1u) == 0)) << f;
  }
  if (mag + 1 == inf_bits) {
    const double ulp = decode(mag) - decode(static_cast<uint16_t>(mag - 1));
    ASSERT_LT(x, decode(mag) + ulp / 2) << f << " should have overflowed";
  } else {
    const double above = std::fabs(x - decode(static_cast<uint16_t>(mag + 1)));
    ASSERT_TRUE(here < above || (here == above && (mag & 1u) == 0)) << f;
  }
}

TEST(DType, ConversionsPickTheNearestValueAcrossTheFloatRange) {
  // A stride coprime to 2 visits every exponent and many mantissa/tie patterns.
  for (uint64_t u = 0; u <= 0xffffffffull; u += 4099) {
    const float f = bits_float(static_cast<uint32_t>(u));
    if (!std::isfinite(f)) continue;
    expect_nearest_even(f, float_to_f16(f), 0x7c00,
                        [](uint16_t h) { return static_cast<double>(f16_to_float(h)); });
    expect_nearest_even(f, float_to_bf16(f), 0x7f80,
                        [](uint16_t h) { return static_cast<double>(bf16_to_float(h)); });
  }
}

TEST(DType, RoundToMatchesStoring) {
  EXPECT_EQ(round_to(DType::F32, 0.1f), 0.1f);
  EXPECT_EQ(round_to(DType::BF16, 0.1f), bf16_to_float(float_to_bf16(0.1f)));
  EXPECT_EQ(round_to(DType::F16, 0.1f), f16_to_float(float_to_f16(0.1f)));
  EXPECT_NE(round_to(DType::BF16, 0.1f), 0.1f);
}

}  // namespace
}  // namespace shardtrain
