#include "shardtrain/backend/nf4_codebook.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace shardtrain::nf4 {

namespace {
// create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8): for each decade
// 10^(i-6), i = 0..6, the midpoints of 2^i + 1 points evenly spaced over [0.1, 1], with both
// signs (254 values), then 0 and 1.
std::array<float, 256> make_dynamic_map() {
  std::vector<double> values;
  for (int i = 0; i < 7; ++i) {
    const int points = (1 << i) + 1;
    const double decade = std::pow(10.0, i - 6);
    for (int j = 0; j + 1 < points; ++j) {
      const double lo = 0.1 + 0.9 * j / (points - 1);
      const double hi = 0.1 + 0.9 * (j + 1) / (points - 1);
      const double mean = decade * (lo + hi) / 2.0;
      values.push_back(mean);
      values.push_back(-mean);
    }
  }
  values.push_back(0.0);
  values.push_back(1.0);
  std::sort(values.begin(), values.end());
  std::array<float, 256> map{};
  for (size_t i = 0; i < map.size(); ++i) map[i] = static_cast<float>(values[i]);
  return map;
}
}  // namespace

const std::array<float, 256>& dynamic_map_8bit() {
  static const std::array<float, 256> map = make_dynamic_map();
  return map;
}

void check_dequantize_operands(const Tensor& codes, const Tensor& absmax_q,
                               const Tensor& absmax_scale, const Tensor& out) {
  ST_CHECK_SHAPE(codes.defined() && absmax_q.defined() && absmax_scale.defined() && out.defined(),
                 "nf4_dequantize: an operand is undefined");
  const int64_t n = out.numel();
  ST_CHECK_SHAPE(codes.dtype() == DType::U8 && codes.numel() >= num_code_bytes(n),
                 "nf4_dequantize: codes must be u8 with at least ", num_code_bytes(n),
                 " bytes for ", n, " weights, got ", codes.describe());
  ST_CHECK_SHAPE(absmax_q.dtype() == DType::U8 && absmax_q.numel() >= num_blocks(n),
                 "nf4_dequantize: absmax_q must be u8 with at least ", num_blocks(n),
                 " blocks, got ", absmax_q.describe());
  ST_CHECK_SHAPE(absmax_scale.dtype() == DType::F32 && absmax_scale.numel() >= num_absmax_groups(n),
                 "nf4_dequantize: absmax_scale must be f32 with at least ", num_absmax_groups(n),
                 " groups, got ", absmax_scale.describe());
  ST_CHECK_SHAPE(is_floating(out.dtype()),
                 "nf4_dequantize: the output must be a float tensor, got ", out.describe());
  for (const Tensor* t : {&codes, &absmax_q, &absmax_scale})
    ST_CHECK_SHAPE(t->device() == out.device(), "nf4_dequantize: ", t->describe(),
                   " is not on the output's device (", out.device().str(), ")");
}

}  // namespace shardtrain::nf4
