// The AdamW update on fp32 master weights and moments.
#include <cmath>

#include "cpu_backend.h"

namespace shardtrain {

void CpuBackend::adamw(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v,
                       const AdamWArgs& args) {
  // Scalars are formed in double and rounded to float once, as PyTorch does with its Python-float
  // hyper-parameters; the per-element operations follow torch.optim.AdamW (single-tensor path),
  // on the gradient times grad_scale (exact when it is 1):
  //   g *= grad_scale;  p *= 1 - lr*wd;  m = beta1*m + (1-beta1)*g;  v = beta2*v + (1-beta2)*g*g;
  //   p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
  const double step = static_cast<double>(args.step);
  const float decay = static_cast<float>(1.0 - static_cast<double>(args.lr) * args.weight_decay);
  const float beta1 = args.beta1, beta2 = args.beta2;
  const float one_minus_beta1 = static_cast<float>(1.0 - static_cast<double>(args.beta1));
  const float one_minus_beta2 = static_cast<float>(1.0 - static_cast<double>(args.beta2));
  const double bc1 = 1.0 - std::pow(static_cast<double>(args.beta1), step);
  const double bc2 = 1.0 - std::pow(static_cast<double>(args.beta2), step);
  const float step_size = static_cast<float>(static_cast<double>(args.lr) / bc1);
  const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  const float eps = args.eps;
  const float grad_scale = args.grad_scale;

  float* p = param.data<float>();
  float* mp = m.data<float>();
  float* vp = v.data<float>();
  cpu::parallel_chunks(param.numel(), [&](int64_t lo, int64_t hi) {
    float g[cpu::kChunk];
    cpu::load_floats(grad, lo, hi - lo, g);
    float* pc = p + lo;
    float* mc = mp + lo;
    float* vc = vp + lo;
#pragma omp simd
    for (int64_t i = 0; i < hi - lo; ++i) {
      const float gi = g[i] * grad_scale;
      const float mi = beta1 * mc[i] + one_minus_beta1 * gi;
      const float vi = beta2 * vc[i] + one_minus_beta2 * gi * gi;
      mc[i] = mi;
      vc[i] = vi;
      const float denom = std::sqrt(vi) / bc2_sqrt + eps;
      pc[i] = pc[i] * decay - step_size * (mi / denom);
    }
  });
}

}  // namespace shardtrain
