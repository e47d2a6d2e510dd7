// Rotary position embedding (Hugging Face rotate-half convention).
#include <cmath>

#include "cpu_backend.h"

namespace shardtrain {

void CpuBackend::rope(const Tensor& x, Tensor& out, const RopeParams& params,
                      int64_t position_offset, bool inverse) {
  const int64_t B = x.size(0), S = x.size(1), H = x.size(2), D = x.size(3);
  const int64_t half = D / 2;
  if (half == 0 || S == 0) return;

  // cos/sin table [S, half], computed in fp32 the way the reference implementation does:
  // angle = position * inv_freq, the inverse frequencies formed once on the host.
  const std::vector<float> inv_freq = rope_inverse_frequencies(D, params);
  Tensor table = cpu::workspace(2 * S * half);
  float* cos_t = table.data<float>();
  float* sin_t = cos_t + S * half;
  const float sign = inverse ? -1.0f : 1.0f;
#pragma omp parallel for schedule(static) if (S * half > cpu::kChunk)
  for (int64_t s = 0; s < S; ++s) {
    const float pos = static_cast<float>(position_offset + s);
    for (int64_t i = 0; i < half; ++i) {
      const float angle = pos * inv_freq[static_cast<size_t>(i)];
      cos_t[s * half + i] = std::cos(angle);
      sin_t[s * half + i] = sign * std::sin(angle);
    }
  }

  constexpr int64_t kHalfChunk = cpu::kChunk / 2;
  const int64_t rows = B * S * H;
#pragma omp parallel for schedule(static) if (rows * D > cpu::kChunk)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t s = (r / H) % S;
    const float* c = cos_t + s * half;
    const float* sn = sin_t + s * half;
    float lo[kHalfChunk], hi[kHalfChunk];
    // Both halves of a chunk are read before either is written, so out may alias x.
    for (int64_t i0 = 0; i0 < half; i0 += kHalfChunk) {
      const int64_t n = std::min(half - i0, kHalfChunk);
      cpu::load_floats(x, r * D + i0, n, lo);
      cpu::load_floats(x, r * D + half + i0, n, hi);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float a = lo[i], b = hi[i];
        lo[i] = a * c[i0 + i] - b * sn[i0 + i];
        hi[i] = b * c[i0 + i] + a * sn[i0 + i];
      }
      cpu::store_floats(lo, n, out, r * D + i0);
      cpu::store_floats(hi, n, out, r * D + half + i0);
    }
  }
}

}  // namespace shardtrain
