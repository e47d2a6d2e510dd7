// Rotary embedding frequencies, shared by every backend (compiled with -ffp-contract=off, like
// the rest of the backend layer, so no product and sum below becomes a fused multiply-add).
#include "shardtrain/backend/rope.h"

#include <cmath>
#include <numbers>
#include <sstream>

#include "shardtrain/core/error.h"

namespace shardtrain {

namespace {
std::string number(double v) {
  std::ostringstream out;
  out << v;
  return out.str();
}
}  // namespace

std::string llama3_rope_scaling_problem(const Llama3RopeScaling& s) {
  if (!std::isfinite(s.factor) || !(s.factor > 0))
    return "factor (" + number(s.factor) + ") must be a number > 0";
  if (!std::isfinite(s.low_freq_factor) || !(s.low_freq_factor > 0))
    return "low_freq_factor (" + number(s.low_freq_factor) + ") must be a number > 0";
  if (!std::isfinite(s.high_freq_factor) || !(s.high_freq_factor > s.low_freq_factor))
    return "high_freq_factor (" + number(s.high_freq_factor) +
           ") must be greater than low_freq_factor (" + number(s.low_freq_factor) + ")";
  if (s.original_max_position_embeddings <= 0)
    return "original_max_position_embeddings (" +
           std::to_string(s.original_max_position_embeddings) + ") must be > 0";
  return "";
}

std::vector<float> rope_inverse_frequencies(int64_t head_dim, const RopeParams& params) {
  ST_CHECK_SHAPE(head_dim > 0 && head_dim % 2 == 0,
                 "rotary embedding needs an even, positive head dimension, got ", head_dim);
  const int64_t half = head_dim / 2;
  std::vector<float> inv_freq(static_cast<size_t>(half));
  // _compute_default_rope_parameters: 1.0 / (base ** (arange(0, dim, 2).float() / dim)).
  for (int64_t i = 0; i < half; ++i)
    inv_freq[static_cast<size_t>(i)] =
        1.0f / std::pow(params.theta, static_cast<float>(2 * i) / static_cast<float>(head_dim));
  if (!params.llama3) return inv_freq;

  const Llama3RopeScaling& s = *params.llama3;
  const std::string problem = llama3_rope_scaling_problem(s);
  ST_CHECK_AS(ConfigError, problem.empty(), "llama3 rope scaling: ", problem);
  // _compute_llama3_parameters. The wavelength bounds and high - low are Python arithmetic
  // (double); a Python number meeting an fp32 tensor is converted to fp32; `a / tensor` is
  // torch's reciprocal-then-multiply (Tensor.__rtruediv__), `tensor / a` a true division.
  const double old_context_len = static_cast<double>(s.original_max_position_embeddings);
  const float low_freq_wavelen = static_cast<float>(old_context_len / s.low_freq_factor);
  const float high_freq_wavelen = static_cast<float>(old_context_len / s.high_freq_factor);
  const float factor = static_cast<float>(s.factor);
  const float low_freq_factor = static_cast<float>(s.low_freq_factor);
  const float band = static_cast<float>(s.high_freq_factor - s.low_freq_factor);
  const float two_pi = static_cast<float>(2 * std::numbers::pi);
  const float old_len = static_cast<float>(old_context_len);
  for (float& f : inv_freq) {
    const float wavelen = (1.0f / f) * two_pi;
    if (wavelen < high_freq_wavelen) continue;  // high frequencies: unchanged
    if (wavelen > low_freq_wavelen) {           // low frequencies: divided by the factor
      f = f / factor;
      continue;
    }
    const float smooth = ((1.0f / wavelen) * old_len - low_freq_factor) / band;
    const float scaled = (1.0f - smooth) * f / factor;
    const float kept = smooth * f;
    f = scaled + kept;
  }
  return inv_freq;
}

}  // namespace shardtrain
