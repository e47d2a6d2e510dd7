// Values as fp32 bit patterns, for tests that compare results bit for bit: -0.0 against 0.0 and
// NaN payloads count as differences, which EXPECT_EQ on floats would not say.
#pragma once
#include <cstdint>
#include <cstring>
#include <vector>

#include "shardtrain/tensor/tensor.h"

namespace shardtrain::testing {

inline std::vector<uint32_t> bits_of(const std::vector<float>& f) {
  std::vector<uint32_t> out(f.size());
  std::memcpy(out.data(), f.data(), f.size() * sizeof(float));
  return out;
}

inline std::vector<uint32_t> bits_of(const Tensor& t) {
  return bits_of(t.to_float_vector());
}

}  // namespace shardtrain::testing
