// SwiGLU gating: out = silu(gate) * up.
#include <cmath>

#include "cpu_backend.h"

namespace shardtrain {

using cpu::kChunk;
using cpu::load_floats;
using cpu::store_floats;

namespace {
inline float sigmoid(float x) {
  return 1.0f / (1.0f + std::exp(-x));
}
}  // namespace

void CpuBackend::swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& out) {
  cpu::parallel_chunks(out.numel(), [&](int64_t lo, int64_t hi) {
    float g[kChunk], u[kChunk];
    const int64_t n = hi - lo;
    load_floats(gate, lo, n, g);
    load_floats(up, lo, n, u);
    for (int64_t i = 0; i < n; ++i) g[i] = g[i] * sigmoid(g[i]) * u[i];
    store_floats(g, n, out, lo);
  });
}

void CpuBackend::swiglu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up,
                                 Tensor& dgate, Tensor& dup) {
  cpu::parallel_chunks(dout.numel(), [&](int64_t lo, int64_t hi) {
    float d[kChunk], g[kChunk], u[kChunk];
    const int64_t n = hi - lo;
    load_floats(dout, lo, n, d);
    load_floats(gate, lo, n, g);
    load_floats(up, lo, n, u);
    for (int64_t i = 0; i < n; ++i) {
      const float s = sigmoid(g[i]);
      const float silu = g[i] * s;
      // d silu / d g = s * (1 + g * (1 - s))
      g[i] = d[i] * u[i] * s * (1.0f + g[i] * (1.0f - s));
      u[i] = d[i] * silu;
    }
    store_floats(g, n, dgate, lo);
    store_floats(u, n, dup, lo);
  });
}

}  // namespace shardtrain
