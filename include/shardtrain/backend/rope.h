// Rotary position embedding frequencies. Every backend rotates by angle = position * inv_freq[i]
// with the inverse frequencies formed on the host by rope_inverse_frequencies(), so the CPU and
// CUDA backends use the same fp32 numbers.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace shardtrain {

// Llama-3 frequency scaling: Hugging Face `rope_scaling` with rope_type "llama3" (Llama-3.1 and
// Llama-3.2 checkpoints). With L = original_max_position_embeddings, a frequency whose
// wavelength 2*pi/inv_freq is longer than L / low_freq_factor is divided by `factor`, one whose
// wavelength is shorter than L / high_freq_factor is kept, and the ones between are interpolated:
//   smooth = (L / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
//   inv_freq = (1 - smooth) * inv_freq / factor + smooth * inv_freq
// The numbers are kept as config.json gives them (doubles, as Python reads them).
struct Llama3RopeScaling {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;

  bool operator==(const Llama3RopeScaling&) const = default;
};

// What a rotary embedding rotates by: the base theta and, optionally, Llama-3 scaling.
struct RopeParams {
  RopeParams() = default;
  explicit RopeParams(float theta_, std::optional<Llama3RopeScaling> llama3_ = std::nullopt)
      : theta(theta_), llama3(llama3_) {}

  float theta = 10000.0f;
  std::optional<Llama3RopeScaling> llama3;  // nullopt: plain RoPE, inv_freq = theta^(-2i/D)

  bool operator==(const RopeParams&) const = default;
};

// "" when the scaling can be used, else what is wrong with it, naming the field as config.json
// names it: factor > 0, 0 < low_freq_factor < high_freq_factor, original_max_position_embeddings
// > 0, every number finite.
std::string llama3_rope_scaling_problem(const Llama3RopeScaling& scaling);

// The head_dim / 2 inverse frequencies (fp32) of an even head_dim, computed as Hugging Face
// transformers computes them (modeling_rope_utils: _compute_default_rope_parameters, then
// _compute_llama3_parameters when params.llama3 is set), each tensor operation rounded to fp32
// in the same order, with Python numbers converted to fp32 where torch converts them. Without
// scaling, inv_freq[i] = 1.0f / powf(theta, float(2i) / float(head_dim)). Throws ShapeError for
// an odd or non-positive head_dim and ConfigError for unusable scaling.
std::vector<float> rope_inverse_frequencies(int64_t head_dim, const RopeParams& params);

}  // namespace shardtrain
