// Finite-difference gradient checking for tests.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <vector>

#include "shardtrain/autograd/engine.h"
#include "shardtrain/autograd/grad_mode.h"
#include "shardtrain/tensor/tensor.h"

namespace shardtrain::testing {

// L(inputs) = sum_i out_i * w_i with fixed random weights w, evaluated in double on the host.
inline double weighted_sum(const Tensor& out, const std::vector<float>& w) {
  std::vector<float> v = out.to_float_vector();
  double s = 0;
  for (size_t i = 0; i < v.size(); ++i) s += static_cast<double>(v[i]) * w[i];
  return s;
}

// Checks d L / d input for every floating input that requires a gradient, along random
// directions and on single elements, against central differences. The function must be
// deterministic. Tolerance is relative to the larger of the two values (and an absolute floor).
inline void gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                      std::vector<Tensor> inputs, double eps = 1e-2, double rtol = 1e-2,
                      double atol = 1e-3, uint64_t seed = 7) {
  Generator gen(seed);
  Tensor out = fn(inputs);
  std::vector<float> w(static_cast<size_t>(out.numel()));
  gen.normal(w.data(), static_cast<int64_t>(w.size()));
  Tensor seed_grad = from_floats(w, out.shape(), out.dtype(), out.device());
  autograd::backward(out, seed_grad);

  for (size_t idx = 0; idx < inputs.size(); ++idx) {
    Tensor& x = inputs[idx];
    if (!autograd::requires_grad(x)) continue;
    Tensor g = autograd::grad(x);
    ASSERT_TRUE(g.defined()) << "input " << idx << " got no gradient";
    std::vector<float> gv = g.to_float_vector();
    std::vector<float> base = x.to_float_vector();
    auto loss_at = [&](const std::vector<float>& values) {
      autograd::NoGrad ng;
      Tensor saved = x.clone();
      x.copy_from(from_floats(values, x.shape(), DType::F32, Device::host()));
      double l = weighted_sum(fn(inputs), w);
      x.copy_from(saved);
      return l;
    };
    // Random directions.
    for (int trial = 0; trial < 3; ++trial) {
      std::vector<float> d(base.size());
      gen.normal(d.data(), static_cast<int64_t>(d.size()));
      std::vector<float> plus(base), minus(base);
      double analytic = 0;
      for (size_t i = 0; i < base.size(); ++i) {
        plus[i] += static_cast<float>(eps) * d[i];
        minus[i] -= static_cast<float>(eps) * d[i];
        analytic += static_cast<double>(gv[i]) * d[i];
      }
      double numeric = (loss_at(plus) - loss_at(minus)) / (2 * eps);
      double tol = atol + rtol * std::max(std::fabs(numeric), std::fabs(analytic));
      EXPECT_NEAR(analytic, numeric, tol) << "input " << idx << " direction " << trial;
    }
    // A few single elements.
    for (int trial = 0; trial < 4; ++trial) {
      float u;
      gen.uniform(&u, 1);
      size_t i =
          std::min(base.size() - 1, static_cast<size_t>(u * static_cast<float>(base.size())));
      std::vector<float> plus(base), minus(base);
      plus[i] += static_cast<float>(eps);
      minus[i] -= static_cast<float>(eps);
      double numeric = (loss_at(plus) - loss_at(minus)) / (2 * eps);
      double tol =
          atol + rtol * std::max(std::fabs(numeric), std::fabs(static_cast<double>(gv[i])));
      EXPECT_NEAR(gv[i], numeric, tol) << "input " << idx << " element " << i;
    }
  }
}

inline Tensor param(const Shape& shape, Generator& gen, float stddev = 1.0f) {
  Tensor t = randn(shape, gen, stddev);
  autograd::set_requires_grad(t);
  return t;
}

}  // namespace shardtrain::testing
