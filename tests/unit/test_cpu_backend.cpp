// Every CPU kernel against a naive double-precision reference written here, in F32 (tight) and
// BF16/F16 (looser, for the final rounding) on shapes that are not powers of two and that cross
// the kernels' internal chunk sizes. Backward kernels are checked against central finite
// differences of the double forward references, or against naive analytic references that are
// themselves checked against finite differences.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "shardtrain/backend/backend.h"

namespace shardtrain {
namespace {

using Vec = std::vector<double>;

constexpr DType kFloatTypes[] = {DType::F32, DType::BF16, DType::F16};

Backend& cpu() {
  return backend_for(Device::cpu());
}

// Relative tolerance for results stored in `t` (the final rounding dominates in 16-bit types).
double tol_for(DType t) {
  switch (t) {
    case DType::F32:
      return 1e-5;
    case DType::F16:
      return 3e-3;
    default:
      return 2e-2;
  }
}

Tensor random(const Shape& shape, DType dtype, uint64_t seed, float stddev = 1.0f) {
  Generator g(seed);
  return randn(shape, g, stddev, dtype);
}

Vec values(const Tensor& t) {
  std::vector<float> f = t.to_float_vector();
  return Vec(f.begin(), f.end());
}

// |actual - expected| <= rtol * max(|expected|, rms(expected)) elementwise.
void expect_close(const Tensor& actual, const Vec& expected, double rtol, const std::string& what) {
  const Vec a = values(actual);
  ASSERT_EQ(a.size(), expected.size()) << what;
  double sq = 0;
  for (double e : expected) sq += e * e;
  const double rms = expected.empty() ? 0.0 : std::sqrt(sq / static_cast<double>(expected.size()));
  int bad = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double err = std::fabs(a[i] - expected[i]);
    if (!(err <= rtol * std::max(std::fabs(expected[i]), rms) + 1e-30)) {
      if (bad < 5)
        ADD_FAILURE() << what << ": element " << i << " is " << a[i] << ", expected " << expected[i]
                      << " (tolerance " << rtol << " relative)";
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << a.size() << " elements out of tolerance";
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
}

// Central finite differences of a scalar function of many variables.
Vec numerical_gradient(const std::function<double(const Vec&)>& f, Vec x, double h = 1e-5) {
  Vec g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    x[i] = saved + h;
    const double up = f(x);
    x[i] = saved - h;
    const double down = f(x);
    x[i] = saved;
    g[i] = (up - down) / (2 * h);
  }
  return g;
}

double dot(const Vec& a, const Vec& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Runs `body` with the given OpenMP thread count, restoring the previous one.
template <typename Body>
void with_threads(int threads, Body body) {
  const int previous = omp_get_max_threads();
  omp_set_num_threads(threads);
  body();
  omp_set_num_threads(previous);
}

// ---------------------------------------------------------------------------------------------

TEST(CpuBackend, IsRegisteredLazilyForCpuAndHost) {
  Backend& b = cpu();
  EXPECT_TRUE(b.device().is_cpu());
  EXPECT_EQ(&backend_for(Device::host()), &b);
#ifndef SHARDTRAIN_HAVE_CUDA
  EXPECT_FALSE(cuda_backend_available());
  EXPECT_THROW(backend_for(Device::cuda(0)), Error);
#endif
}

// ---- gemm -----------------------------------------------------------------------------------

struct GemmCase {
  bool ta, tb;
  int64_t m, n, k, batch;
  int64_t sa, sb, sc;  // strides; -1 = packed (one matrix after another)
  int64_t oa, ob, oc;
  float alpha, beta;
};

// Naive reference: returns the full C storage after the product.
Vec gemm_reference(const GemmArgs& g, const Vec& A, const Vec& B, Vec C) {
  for (int64_t bt = 0; bt < g.batch; ++bt) {
    for (int64_t i = 0; i < g.m; ++i) {
      for (int64_t j = 0; j < g.n; ++j) {
        double s = 0;
        for (int64_t p = 0; p < g.k; ++p) {
          const double a =
              A[g.offset_a + bt * g.stride_a + (g.trans_a ? p * g.m + i : i * g.k + p)];
          const double b =
              B[g.offset_b + bt * g.stride_b + (g.trans_b ? j * g.k + p : p * g.n + j)];
          s += a * b;
        }
        double& c = C[g.offset_c + bt * g.stride_c + i * g.n + j];
        c = g.alpha * s + (g.beta == 0.0f ? 0.0 : g.beta * c);
      }
    }
  }
  return C;
}

void run_gemm_case(const GemmCase& gc, DType ta, DType tb, DType tc, uint64_t seed) {
  GemmArgs g;
  g.trans_a = gc.ta;
  g.trans_b = gc.tb;
  g.m = gc.m;
  g.n = gc.n;
  g.k = gc.k;
  g.batch = gc.batch;
  g.alpha = gc.alpha;
  g.beta = gc.beta;
  g.stride_a = gc.sa < 0 ? gc.m * gc.k : gc.sa;
  g.stride_b = gc.sb < 0 ? gc.k * gc.n : gc.sb;
  g.stride_c = gc.sc < 0 ? gc.m * gc.n : gc.sc;
  g.offset_a = gc.oa;
  g.offset_b = gc.ob;
  g.offset_c = gc.oc;
  auto storage = [&](int64_t offset, int64_t stride, int64_t elems) {
    return offset + (g.batch - 1) * stride + elems + 3;  // a few trailing elements untouched
  };
  Tensor a = random({storage(g.offset_a, g.stride_a, g.m * g.k)}, ta, seed);
  Tensor b = random({storage(g.offset_b, g.stride_b, g.k * g.n)}, tb, seed + 1);
  Tensor c = random({storage(g.offset_c, g.stride_c, g.m * g.n)}, tc, seed + 2);
  const Vec expected = gemm_reference(g, values(a), values(b), values(c));
  cpu().gemm(g, a, b, c);
  const std::string what = std::string("gemm ") + (gc.ta ? "T" : "N") + (gc.tb ? "T" : "N") +
                           " m=" + std::to_string(g.m) + " n=" + std::to_string(g.n) +
                           " k=" + std::to_string(g.k) + " batch=" + std::to_string(g.batch) + " " +
                           std::string(dtype_name(ta)) + "/" + std::string(dtype_name(tb)) + "/" +
                           std::string(dtype_name(tc));
  expect_close(c, expected, tol_for(tc), what);
}

TEST(CpuBackend, GemmMatchesNaiveProduct) {
  const GemmCase cases[] = {
      {false, false, 3, 5, 7, 1, -1, -1, -1, 0, 0, 0, 1.0f, 0.0f},
      {true, false, 17, 33, 9, 1, -1, -1, -1, 0, 0, 0, 1.0f, 0.0f},
      {false, true, 17, 33, 9, 1, -1, -1, -1, 0, 0, 0, 0.5f, 1.0f},
      {true, true, 5, 3, 7, 1, -1, -1, -1, 0, 0, 0, -1.5f, 0.25f},
      {false, false, 1, 1, 1, 1, -1, -1, -1, 0, 0, 0, 1.0f, 0.0f},
      // Batched with gaps between matrices, offsets, and a broadcast B (stride 0).
      {false, false, 3, 5, 7, 3, 3 * 7 + 2, 0, 3 * 5 + 1, 1, 2, 3, 0.7f, 0.3f},
      {true, true, 4, 6, 5, 2, -1, -1, -1, 4, 0, 5, 1.0f, 1.0f},
      // Nothing to sum over: C = beta * C.
      {false, false, 4, 3, 0, 1, -1, -1, -1, 0, 0, 0, 1.0f, 0.5f},
  };
  uint64_t seed = 1;
  for (DType t : kFloatTypes)
    for (const GemmCase& gc : cases) run_gemm_case(gc, t, t, t, seed += 3);
  // Operands of different dtypes.
  run_gemm_case(cases[1], DType::BF16, DType::F32, DType::F16, 100);
  run_gemm_case(cases[5], DType::F16, DType::BF16, DType::F32, 200);
}

// Two 2x3 = (2x4)(4x3) products, A and B packed (16 and 24 elements), C matrices `stride_c` apart.
GemmArgs two_small_products(int64_t stride_c) {
  GemmArgs g;
  g.m = 2;
  g.n = 3;
  g.k = 4;
  g.batch = 2;
  g.stride_a = 8;
  g.stride_b = 12;
  g.stride_c = stride_c;
  return g;
}

TEST(CpuBackend, GemmWithZeroBetaOverwritesNanAndLeavesGapsAlone) {
  for (DType t : kFloatTypes) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    GemmArgs g = two_small_products(7);  // one gap element after each 2x3 matrix
    g.offset_c = 1;
    Tensor a = random({16}, t, 5), b = random({24}, t, 6);
    Tensor c = full({15}, std::numeric_limits<float>::quiet_NaN(), t);
    Vec expected = gemm_reference(g, values(a), values(b), Vec(15, 0.0));
    cpu().gemm(g, a, b, c);
    const Vec got = values(c);
    for (int64_t gap : {0, 7, 14}) EXPECT_TRUE(std::isnan(got[gap])) << gap;
    for (int64_t bt = 0; bt < 2; ++bt)
      for (int64_t i = 0; i < 6; ++i) {
        const int64_t idx = 1 + bt * 7 + i;
        EXPECT_NEAR(got[idx], expected[idx], tol_for(t) * 4) << idx;
      }
  }
}

TEST(CpuBackend, GemmRejectsMatricesOutsideTheirTensorsAndOverlappingOutputs) {
  const GemmArgs g = two_small_products(6);
  Tensor a = random({16}, DType::F32, 7), b = random({24}, DType::F32, 8);
  Tensor c = zeros({12});
  cpu().gemm(g, a, b, c);  // exactly fits
  auto rejects = [&](GemmArgs bad, const std::string& words) {
    try {
      cpu().gemm(bad, a, b, c);
      ADD_FAILURE() << "accepted: " << words;
    } catch (const ShapeError& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  GemmArgs bad = g;
  bad.offset_a = 1;  // A's second matrix runs one element past its end
  rejects(bad, "need 17 elements of A");
  bad = g;
  bad.stride_b = 13;
  rejects(bad, "need 25 elements of B");
  bad = g;
  bad.offset_c = 1;
  rejects(bad, "need 13 elements of C");
  bad = g;
  bad.stride_c = 0;  // both products would write the same C
  rejects(bad, "overlap");
  bad = g;
  bad.stride_c = 5;
  rejects(bad, "overlap");
  bad = g;
  bad.offset_b = -1;
  rejects(bad, "negative offset");
  bad = g;
  bad.k = -1;
  rejects(bad, "negative size");
  // With nothing to multiply (k = 0) only C is touched, so A and B may be empty.
  bad = g;
  bad.k = 0;
  Tensor none = empty({0});
  cpu().gemm(bad, none, none, c);
  for (float v : c.to_float_vector()) EXPECT_EQ(v, 0.0f);
}

// ---- elementwise ----------------------------------------------------------------------------

TEST(CpuBackend, FillAndCast) {
  for (DType t : kFloatTypes) {
    Tensor x = empty({17, 33, 5}, t);
    cpu().fill(x, 0.1f);
    for (double v : values(x)) ASSERT_EQ(v, round_to(t, 0.1f));
  }
  Tensor ids = empty({2000}, DType::I64);
  cpu().fill(ids, 7.0f);
  for (int64_t v : ids.to_int_vector()) ASSERT_EQ(v, 7);

  Tensor src = random({17, 33, 5}, DType::F32, 11, 100.0f);
  const std::vector<float> ref = src.to_float_vector();
  for (DType t : kFloatTypes) {
    Tensor dst = empty({17, 33, 5}, t);
    cpu().cast(src, dst);
    const std::vector<float> got = dst.to_float_vector();
    for (size_t i = 0; i < ref.size(); ++i) ASSERT_EQ(got[i], round_to(t, ref[i])) << i;
    // And back: a rounded tensor converts between types exactly where the value fits.
    Tensor f32 = empty({17, 33, 5});
    cpu().cast(dst, f32);
    EXPECT_EQ(f32.to_float_vector(), got);
  }
}

TEST(CpuBackend, AddMulScale) {
  for (const Shape& shape : {Shape{3, 5, 7}, Shape{17, 33, 5}}) {
    for (DType t : kFloatTypes) {
      SCOPED_TRACE(std::string(dtype_name(t)) + shape_str(shape));
      Tensor a = random(shape, t, 1), b = random(shape, t, 2);
      const Vec va = values(a), vb = values(b);
      Vec sum(va.size()), prod(va.size()), scaled(va.size());
      for (size_t i = 0; i < va.size(); ++i) {
        sum[i] = 0.5 * va[i] - 2.0 * vb[i];
        prod[i] = va[i] * vb[i];
        scaled[i] = -3.0 * va[i];
      }
      Tensor out = empty(shape, t);
      cpu().add(a, b, out, 0.5f, -2.0f);
      expect_close(out, sum, tol_for(t), "add");
      cpu().mul(a, b, out);
      expect_close(out, prod, tol_for(t), "mul");
      cpu().scale(a, out, -3.0f);
      expect_close(out, scaled, tol_for(t), "scale");
      // In place: out aliases an input.
      Tensor a2 = a.clone();
      cpu().add(a2, b, a2, 0.5f, -2.0f);
      expect_close(a2, sum, tol_for(t), "add in place");
      Tensor b2 = b.clone();
      cpu().mul(a, b2, b2);
      expect_close(b2, prod, tol_for(t), "mul in place");
    }
  }
}

TEST(CpuBackend, MulLastDimAndItsWeightGradient) {
  for (const Shape& shape : {Shape{3, 5, 7}, Shape{7, 300}}) {
    for (DType t : kFloatTypes) {
      SCOPED_TRACE(std::string(dtype_name(t)) + shape_str(shape));
      const int64_t width = shape.back();
      Tensor x = random(shape, t, 3), w = random({width}, t, 4), dy = random(shape, t, 5);
      const Vec vx = values(x), vw = values(w), vdy = values(dy);
      Vec y(vx.size());
      for (size_t i = 0; i < vx.size(); ++i) y[i] = vx[i] * vw[i % width];
      Tensor out = empty(shape, t);
      cpu().mul_lastdim(x, w, out);
      expect_close(out, y, tol_for(t), "mul_lastdim");
      Tensor x2 = x.clone();
      cpu().mul_lastdim(x2, w, x2);
      EXPECT_TRUE(bitwise_equal(x2, out));

      Tensor gw = random({width}, DType::F32, 6);  // accumulates onto existing values
      Vec expected = values(gw);
      for (size_t i = 0; i < vx.size(); ++i) expected[i % width] += vdy[i] * vx[i];
      cpu().mul_lastdim_backward_weight(dy, x, gw);
      expect_close(gw, expected, 1e-5, "mul_lastdim_backward_weight");
    }
  }
}

TEST(CpuBackend, Permute0213) {
  const int64_t A = 2, B = 3, C = 5, D = 7;
  for (DType t : kFloatTypes) {
    Tensor x = random({A, B, C, D}, t, 8);
    const Vec vx = values(x);
    Vec expected(vx.size());
    for (int64_t a = 0; a < A; ++a)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t c = 0; c < C; ++c)
          for (int64_t d = 0; d < D; ++d)
            expected[((a * C + c) * B + b) * D + d] = vx[((a * B + b) * C + c) * D + d];
    Tensor out = empty({A, C, B, D}, t);
    cpu().permute_0213(x, out);
    EXPECT_EQ(values(out), expected) << dtype_name(t);
    // With a dtype change the values are rounded once.
    Tensor out32 = empty({A, C, B, D}, DType::F32);
    cpu().permute_0213(x, out32);
    EXPECT_EQ(values(out32), expected);
  }
}

// ---- embedding ------------------------------------------------------------------------------

TEST(CpuBackend, EmbeddingForwardAndBackward) {
  const int64_t V = 11, H = 300;
  const std::vector<int64_t> id_values = {3, 0, 10, 3, 7, 3, 10, 1, 0};
  const int64_t N = static_cast<int64_t>(id_values.size());
  Tensor ids = from_ints(id_values, {N});
  for (DType t : kFloatTypes) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    Tensor w = random({V, H}, t, 9);
    const Vec vw = values(w);
    Tensor out = empty({N, H}, t);
    cpu().embedding_forward(w, ids, out);
    Vec expected(static_cast<size_t>(N * H));
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < H; ++j) expected[i * H + j] = vw[id_values[i] * H + j];
    EXPECT_EQ(values(out), expected);

    Tensor dout = random({N, H}, t, 10);
    const Vec vd = values(dout);
    Tensor gw = random({V, H}, DType::F32, 11);
    Vec gexp = values(gw);
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < H; ++j) gexp[id_values[i] * H + j] += vd[i * H + j];
    cpu().embedding_backward(dout, ids, gw);
    expect_close(gw, gexp, 1e-6, "embedding_backward");
  }
  Tensor w = random({V, H}, DType::F32, 9);
  Tensor out = empty({1, H});
  auto message = [&](int64_t id) {
    try {
      cpu().embedding_forward(w, from_ints({id}, {1}), out);
    } catch (const ShapeError& e) {
      return std::string(e.what());
    }
    ADD_FAILURE() << "token id " << id << " accepted";
    return std::string();
  };
  EXPECT_NE(message(V).find("tokenized with a vocabulary larger"), std::string::npos);
  EXPECT_NE(message(-1).find("ids are never negative"), std::string::npos);
}

TEST(CpuBackend, EmbeddingBackwardIsDeterministic) {
  const int64_t V = 50, H = 700, N = 4000;
  Generator g(3);
  std::vector<float> u(N);
  g.uniform(u.data(), N);
  std::vector<int64_t> id_values(N);
  for (int64_t i = 0; i < N; ++i) id_values[i] = static_cast<int64_t>(u[i] * 8);  // many repeats
  Tensor ids = from_ints(id_values, {N});
  Tensor dout = random({N, H}, DType::BF16, 4);
  auto run = [&](int threads) {
    Tensor gw = zeros({V, H});
    with_threads(threads, [&] { cpu().embedding_backward(dout, ids, gw); });
    return gw;
  };
  Tensor first = run(2), second = run(2), single = run(1), many = run(5);
  EXPECT_TRUE(bitwise_equal(first, second));
  EXPECT_TRUE(bitwise_equal(first, single));
  EXPECT_TRUE(bitwise_equal(first, many));
}

// ---- rmsnorm --------------------------------------------------------------------------------

Vec rmsnorm_reference(const Vec& x, const Vec& w, double eps, Vec* rstd = nullptr) {
  const size_t H = w.size(), N = x.size() / H;
  Vec y(x.size());
  if (rstd) rstd->resize(N);
  for (size_t r = 0; r < N; ++r) {
    double ss = 0;
    for (size_t j = 0; j < H; ++j) ss += x[r * H + j] * x[r * H + j];
    const double rs = 1.0 / std::sqrt(ss / static_cast<double>(H) + eps);
    if (rstd) (*rstd)[r] = rs;
    for (size_t j = 0; j < H; ++j) y[r * H + j] = x[r * H + j] * rs * w[j];
  }
  return y;
}

TEST(CpuBackend, RmsNormForwardAndBackward) {
  const float eps = 1e-5f;
  const std::pair<int64_t, int64_t> sizes[] = {{5, 33}, {3, 1500}};
  for (const auto& [N, H] : sizes) {
    for (DType t : kFloatTypes) {
      SCOPED_TRACE(std::string(dtype_name(t)) + " N=" + std::to_string(N) +
                   " H=" + std::to_string(H));
      Tensor x = random({N, H}, t, 12), w = random({H}, t, 13), dy = random({N, H}, t, 14);
      const Vec vx = values(x), vw = values(w), vdy = values(dy);
      Vec rstd_ref;
      const Vec y_ref = rmsnorm_reference(vx, vw, eps, &rstd_ref);
      Tensor y = empty({N, H}, t), rstd = empty({N}, DType::F32);
      cpu().rmsnorm_forward(x, w, eps, y, rstd);
      expect_close(y, y_ref, tol_for(t), "rmsnorm y");
      expect_close(rstd, rstd_ref, 1e-6, "rmsnorm rstd");

      Tensor dx = empty({N, H}, t);
      Tensor dw = random({H}, DType::F32, 15);
      Vec dw_ref = values(dw);
      cpu().rmsnorm_backward(dy, x, w, rstd, dx, dw);
      // Finite differences on the small shape; the wide one: RmsNormBackwardOnWideRows.
      if (H > 100) continue;
      const Vec dx_ref = numerical_gradient(
          [&](const Vec& xs) { return dot(vdy, rmsnorm_reference(xs, vw, eps)); }, vx);
      const Vec dw_num = numerical_gradient(
          [&](const Vec& ws) { return dot(vdy, rmsnorm_reference(vx, ws, eps)); }, vw);
      for (size_t j = 0; j < dw_ref.size(); ++j) dw_ref[j] += dw_num[j];
      expect_close(dx, dx_ref, tol_for(t) * 2, "rmsnorm dx");
      expect_close(dw, dw_ref, 1e-5, "rmsnorm dw");
    }
  }
}

TEST(CpuBackend, RmsNormBackwardOnWideRows) {
  // Rows wider than one chunk, in every dtype: compare with the analytic gradient (validated by
  // finite differences above) of the inputs as rounded to that dtype.
  const int64_t N = 3, H = 1500;
  const double eps = 1e-5;
  for (DType t : kFloatTypes) {
    SCOPED_TRACE(dtype_name(t));
    Tensor x = random({N, H}, t, 16), w = random({H}, t, 17), dy = random({N, H}, t, 18);
    const Vec vx = values(x), vw = values(w), vdy = values(dy);
    Vec rs;
    rmsnorm_reference(vx, vw, eps, &rs);
    Vec dx_ref(vx.size()), dw_ref(H, 0.0);
    for (int64_t r = 0; r < N; ++r) {
      double s = 0;
      for (int64_t j = 0; j < H; ++j) s += vdy[r * H + j] * vw[j] * vx[r * H + j];
      for (int64_t j = 0; j < H; ++j) {
        dx_ref[r * H + j] = rs[r] * vw[j] * vdy[r * H + j] -
                            vx[r * H + j] * rs[r] * rs[r] * rs[r] * s / static_cast<double>(H);
        dw_ref[j] += vdy[r * H + j] * vx[r * H + j] * rs[r];
      }
    }
    Tensor y = empty({N, H}, t), rstd = empty({N}), dx = empty({N, H}, t), dw = zeros({H});
    cpu().rmsnorm_forward(x, w, static_cast<float>(eps), y, rstd);
    cpu().rmsnorm_backward(dy, x, w, rstd, dx, dw);
    expect_close(dx, dx_ref, t == DType::F32 ? 1e-5 : tol_for(t) * 2, "rmsnorm dx wide");
    expect_close(dw, dw_ref, 1e-5, "rmsnorm dw wide");
  }
}

// ---- rope -----------------------------------------------------------------------------------

// Rotation by angle (offset + p) * inv_freq[i] in double.
Vec rope_reference(const Vec& x, const Shape& s, const Vec& inv_freq, int64_t offset,
                   bool inverse) {
  const int64_t B = s[0], S = s[1], H = s[2], D = s[3], half = D / 2;
  Vec out(x.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t p = 0; p < S; ++p)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t base = ((b * S + p) * H + h) * D;
        for (int64_t i = 0; i < half; ++i) {
          const double angle = static_cast<double>(offset + p) * inv_freq[static_cast<size_t>(i)] *
                               (inverse ? -1.0 : 1.0);
          const double lo = x[base + i], hi = x[base + i + half];
          out[base + i] = lo * std::cos(angle) - hi * std::sin(angle);
          out[base + i + half] = hi * std::cos(angle) + lo * std::sin(angle);
        }
      }
  return out;
}

// theta^(-2i/D) in double.
Vec plain_inv_freq(int64_t D, double theta) {
  Vec f(static_cast<size_t>(D / 2));
  for (size_t i = 0; i < f.size(); ++i) f[i] = std::pow(theta, -2.0 * static_cast<double>(i) / D);
  return f;
}

// Llama-3 scaling of theta^(-2i/D) in double, written from the description of
// _compute_llama3_parameters in Hugging Face transformers.
Vec llama3_inv_freq(int64_t D, double theta, const Llama3RopeScaling& s) {
  Vec f = plain_inv_freq(D, theta);
  const double L = static_cast<double>(s.original_max_position_embeddings);
  for (double& v : f) {
    const double wavelen = 2 * M_PI / v;
    if (wavelen < L / s.high_freq_factor) continue;
    if (wavelen > L / s.low_freq_factor) {
      v /= s.factor;
      continue;
    }
    const double smooth =
        (L / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
    v = (1 - smooth) * v / s.factor + smooth * v;
  }
  return f;
}

Vec rope_reference(const Vec& x, const Shape& s, double theta, int64_t offset, bool inverse) {
  return rope_reference(x, s, plain_inv_freq(s[3], theta), offset, inverse);
}

TEST(CpuBackend, RopeRotatesHalvesAndInverts) {
  for (const Shape& shape : {Shape{2, 5, 3, 8}, Shape{1, 7, 2, 6}}) {
    for (DType t : kFloatTypes) {
      SCOPED_TRACE(std::string(dtype_name(t)) + shape_str(shape));
      Tensor x = random(shape, t, 19);
      const Vec vx = values(x);
      Tensor out = empty(shape, t);
      cpu().rope(x, out, RopeParams{10000.0f}, 3, false);
      expect_close(out, rope_reference(vx, shape, 10000.0, 3, false), tol_for(t), "rope");
      cpu().rope(x, out, RopeParams{500000.0f}, 2, true);
      expect_close(out, rope_reference(vx, shape, 500000.0, 2, true), tol_for(t), "rope inverse");
      // In place gives the same result, and the inverse undoes the forward rotation.
      Tensor y = x.clone();
      cpu().rope(y, y, RopeParams{500000.0f}, 2, true);
      EXPECT_TRUE(bitwise_equal(y, out));
      if (t == DType::F32) {
        Tensor z = x.clone();
        cpu().rope(z, z, RopeParams{10000.0f}, 5, false);
        cpu().rope(z, z, RopeParams{10000.0f}, 5, true);
        expect_close(z, vx, 1e-6, "rope round trip");
      }
    }
  }
}

TEST(CpuBackend, RopeAtLargePositions) {
  // Angles are formed in fp32 (as the reference Hugging Face implementation does), so far from
  // position 0 they differ from exact angles by about position * 2^-24 radians.
  const Shape shape{1, 3, 1, 64};
  Tensor x = random(shape, DType::F32, 20);
  Tensor out = empty(shape);
  cpu().rope(x, out, RopeParams{10000.0f}, 4096, false);
  expect_close(out, rope_reference(values(x), shape, 10000.0, 4096, false), 2e-3, "rope 4096");
}

TEST(CpuBackend, RopeWithLlama3Scaling) {
  // Head dims 16 and 128 put frequencies in all three bands (kept, interpolated, divided).
  const Llama3RopeScaling llama31{8.0, 1.0, 4.0, 8192};
  const Llama3RopeScaling small{3.0, 0.5, 2.5, 100};
  struct Case {
    Shape shape;
    float theta;
    Llama3RopeScaling scaling;
    int64_t offset;
  };
  for (const Case& c :
       {Case{{2, 5, 3, 128}, 500000.0f, llama31, 3}, Case{{1, 7, 2, 16}, 10000.0f, small, 40}}) {
    const RopeParams params{c.theta, c.scaling};
    const Vec inv_freq = llama3_inv_freq(c.shape[3], c.theta, c.scaling);
    for (DType t : kFloatTypes) {
      SCOPED_TRACE(std::string(dtype_name(t)) + shape_str(c.shape));
      Tensor x = random(c.shape, t, 21);
      const Vec vx = values(x);
      Tensor out = empty(c.shape, t);
      cpu().rope(x, out, params, c.offset, false);
      expect_close(out, rope_reference(vx, c.shape, inv_freq, c.offset, false), tol_for(t),
                   "scaled rope");
      if (t == DType::F32) {
        // The scaling matters: the unscaled rotation is 100 tolerances away from this one.
        const Vec plain =
            rope_reference(vx, c.shape, static_cast<double>(c.theta), c.offset, false);
        const Vec got = values(out);
        double diff = 0;
        for (size_t i = 0; i < got.size(); ++i) diff = std::max(diff, std::fabs(got[i] - plain[i]));
        EXPECT_GT(diff, 1e-3);
      }
      cpu().rope(x, out, params, c.offset, true);
      expect_close(out, rope_reference(vx, c.shape, inv_freq, c.offset, true), tol_for(t),
                   "scaled rope inverse");
      if (t == DType::F32) {
        Tensor z = x.clone();
        cpu().rope(z, z, params, c.offset, false);
        cpu().rope(z, z, params, c.offset, true);
        expect_close(z, vx, 1e-6, "scaled rope round trip");
      }
    }
  }
}

// ---- rope frequencies -----------------------------------------------------------------------

TEST(RopeFrequencies, PlainAreTheHostExpression) {
  for (int64_t D : {2, 6, 64, 128, 2050})
    for (float theta : {10000.0f, 500000.0f}) {
      const std::vector<float> f = rope_inverse_frequencies(D, RopeParams{theta});
      ASSERT_EQ(f.size(), static_cast<size_t>(D / 2));
      for (int64_t i = 0; i < D / 2; ++i) {
        const float want =
            1.0f / std::pow(theta, static_cast<float>(2 * i) / static_cast<float>(D));
        EXPECT_EQ(std::memcmp(&f[static_cast<size_t>(i)], &want, sizeof want), 0)
            << "D " << D << " theta " << theta << " i " << i;
      }
    }
}

TEST(RopeFrequencies, Llama3MatchesTransformersFormula) {
  // Computed in float64 by tests/unit/llama3_rope_reference.py (Python's math module only, the
  // formula of transformers' _compute_llama3_parameters written out independently). The fp32
  // results differ from them by the rounding of theta's exponent and of each operation: a few
  // ulps, relative 5e-6 at most.
  struct Case {
    int64_t dim;
    float theta;
    Llama3RopeScaling scaling;
    std::vector<double> want;
  };
  // clang-format off
  const std::vector<Case> cases = {
      {128, 500000.0f, {8.0, 1.0, 4.0, 8192},  // Llama-3.1-8B
       {1, 0.81461723385654472, 0.66360123769608848, 0.54058100463576697, 0.44036660267178046,
        0.35873022375128993, 0.29222782257301511, 0.2380538204803507, 0.19392274474868576,
        0.15797280990904317, 0.12868737343265052, 0.10483095217796996, 0.085397100285765609,
        0.069565949614160322, 0.056669621445291044, 0.04616405026546052, 0.037606030930863933,
        0.030634520893224042, 0.024955408670558694, 0.020329105980970156, 0.016560440080994446,
        0.013490419890226748, 0.010989528534539826, 0.0089522593361943993, 0.0072926647372171085,
        0.0059407303756749668, 0.0048394213457198928, 0.0039422760301166563,
        0.0032114459947525913, 0.0021665707635033591, 0.0013718935677611381,
        0.00085675141291963208, 0.00052484616099295468, 0.00031269375038406517,
        0.00017850781276799638, 9.5562123539646833e-05, 7.7846552739324498e-05,
        6.3415143457776151e-05, 5.1659068748189563e-05, 4.2082367687255257e-05,
        3.4281021959525912e-05, 2.7925911282444464e-05, 2.2748928601828183e-05,
        1.8531669290821308e-05, 1.509621717643313e-05, 1.2297638677963614e-05,
        1.0017868402809974e-05, 8.1607282474359434e-06, 6.6478698711812362e-06,
        5.4154693654999229e-06, 4.4115346745584042e-06, 3.593712173650999e-06,
        2.9274998701761677e-06, 2.3847918463583037e-06, 1.942692537204043e-06,
        1.5825508208909101e-06, 1.2891731721515574e-06, 1.0501826834601687e-06,
        8.5549691264436605e-07, 6.9690252855116753e-07, 5.6770881007598369e-07,
        4.6246538050008837e-07, 3.7673226901739635e-07, 3.0689259889145111e-07}},
      {64, 500000.0f, {32.0, 1.0, 4.0, 8192},  // Llama-3.2-1B
       {1, 0.66360123769608848, 0.44036660267178046, 0.29222782257301511, 0.19392274474868576,
        0.12868737343265052, 0.085397100285765609, 0.056669621445291044, 0.037606030930863933,
        0.024955408670558694, 0.016560440080994446, 0.010989528534539826, 0.0072926647372171085,
        0.0048394213457198928, 0.0032114459947525913, 0.001290547928209264,
        0.00042955679655936815, 9.7082878026276702e-05, 1.9461638184831125e-05,
        1.2914767187047391e-05, 8.5702554898814781e-06, 5.6872321504570457e-06,
        3.7740542941082826e-06, 2.5044671007024935e-06, 1.6619674677953091e-06,
        1.102883668639601e-06, 7.3187496754404192e-07, 4.8567313430101075e-07,
        3.2229329303788936e-07, 2.1387422816109151e-07, 1.4192720251899592e-07,
        9.4183067254349087e-08}},
      {16, 10000.0f, {3.0, 0.5, 2.5, 100},  // two kept, two interpolated, four divided
       {1, 0.31622776601683794, 0.069718314363965125, 0.010575627536677143,
        0.0033333333333333335, 0.0010540925533894597, 0.00033333333333333332,
        0.00010540925533894598}},
  };
  // clang-format on
  for (const Case& c : cases) {
    SCOPED_TRACE("dim " + std::to_string(c.dim) + " factor " + std::to_string(c.scaling.factor));
    const std::vector<float> plain = rope_inverse_frequencies(c.dim, RopeParams{c.theta});
    const std::vector<float> got = rope_inverse_frequencies(c.dim, RopeParams{c.theta, c.scaling});
    ASSERT_EQ(got.size(), c.want.size());
    const double L = static_cast<double>(c.scaling.original_max_position_embeddings);
    int kept = 0, divided = 0, interpolated = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_NEAR(got[i], c.want[i], 5e-6 * c.want[i]) << "i = " << i;
      // Outside the band the result is the plain frequency, or exactly it over the factor.
      const double wavelen = 2 * M_PI / plain[i];
      if (wavelen < L / c.scaling.high_freq_factor) {
        EXPECT_EQ(got[i], plain[i]) << "i = " << i;
        ++kept;
      } else if (wavelen > L / c.scaling.low_freq_factor) {
        EXPECT_EQ(got[i], plain[i] / static_cast<float>(c.scaling.factor)) << "i = " << i;
        ++divided;
      } else {
        ++interpolated;
      }
    }
    EXPECT_GT(kept, 0);
    EXPECT_GT(divided, 0);
    EXPECT_GT(interpolated, 0);
  }
}

TEST(RopeFrequencies, RejectsUnusableScaling) {
  auto problem = [](Llama3RopeScaling s) { return llama3_rope_scaling_problem(s); };
  EXPECT_EQ(problem({8.0, 1.0, 4.0, 8192}), "");
  EXPECT_NE(problem({0.0, 1.0, 4.0, 8192}).find("factor (0) must be a number > 0"),
            std::string::npos);
  EXPECT_NE(problem({8.0, 4.0, 4.0, 8192})
                .find("high_freq_factor (4) must be greater than "
                      "low_freq_factor (4)"),
            std::string::npos);
  EXPECT_NE(problem({8.0, 0.0, 4.0, 8192}).find("low_freq_factor (0)"), std::string::npos);
  EXPECT_NE(problem({8.0, 1.0, 4.0, 0}).find("original_max_position_embeddings (0) must be > 0"),
            std::string::npos);
  EXPECT_NE(problem({std::nan(""), 1.0, 4.0, 8192}).find("factor"), std::string::npos);
  EXPECT_THROW(rope_inverse_frequencies(64, RopeParams{1e4f, Llama3RopeScaling{8.0, 4.0, 1.0, 8}}),
               ConfigError);
  EXPECT_THROW(rope_inverse_frequencies(7, RopeParams{1e4f}), ShapeError);
  Tensor x = random({1, 2, 1, 8}, DType::F32, 22), out = empty({1, 2, 1, 8});
  EXPECT_THROW(cpu().rope(x, out, RopeParams{1e4f, Llama3RopeScaling{-1.0, 1.0, 4.0, 8}}, 0, false),
               ConfigError);
}

// ---- causal softmax -------------------------------------------------------------------------

Vec causal_softmax_reference(const Vec& s, int64_t Sq, int64_t Sk, double scale) {
  Vec p(s.size(), 0.0);
  const int64_t rows = static_cast<int64_t>(s.size()) / Sk;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t q = r % Sq, valid = q + (Sk - Sq) + 1;
    double mx = -1e300, total = 0;
    for (int64_t j = 0; j < valid; ++j) mx = std::max(mx, scale * s[r * Sk + j]);
    for (int64_t j = 0; j < valid; ++j) total += std::exp(scale * s[r * Sk + j] - mx);
    for (int64_t j = 0; j < valid; ++j)
      p[r * Sk + j] = std::exp(scale * s[r * Sk + j] - mx) / total;
  }
  return p;
}

TEST(CpuBackend, CausalSoftmaxForwardAndBackward) {
  const float scale = 0.37f;
  for (const Shape& shape : {Shape{2, 4, 6}, Shape{3, 5, 5}, Shape{1, 2, 1500}}) {
    for (DType t : kFloatTypes) {
      SCOPED_TRACE(std::string(dtype_name(t)) + shape_str(shape));
      const int64_t Sq = shape[1], Sk = shape[2];
      Tensor s = random(shape, t, 21, 3.0f), dp = random(shape, t, 22);
      const Vec vs = values(s), vdp = values(dp);
      const Vec p_ref = causal_softmax_reference(vs, Sq, Sk, scale);
      Tensor p = empty(shape, t);
      cpu().causal_softmax(s, scale, p);
      expect_close(p, p_ref, tol_for(t), "causal_softmax");
      const Vec vp = values(p);
      for (size_t i = 0; i < vp.size(); ++i) {
        if (p_ref[i] == 0.0) {
          ASSERT_EQ(vp[i], 0.0) << "masked entry " << i;
        }
      }
      Tensor in_place = s.clone();
      cpu().causal_softmax(in_place, scale, in_place);
      EXPECT_TRUE(bitwise_equal(in_place, p));

      Tensor ds = empty(shape, t);
      cpu().causal_softmax_backward(p, dp, scale, ds);
      // Header formula evaluated in double on the probabilities the kernel was given.
      Vec ds_ref(vp.size());
      for (int64_t r = 0; r < static_cast<int64_t>(vp.size()) / Sk; ++r) {
        double d = 0;
        for (int64_t j = 0; j < Sk; ++j) d += vp[r * Sk + j] * vdp[r * Sk + j];
        for (int64_t j = 0; j < Sk; ++j)
          ds_ref[r * Sk + j] = scale * vp[r * Sk + j] * (vdp[r * Sk + j] - d);
      }
      expect_close(ds, ds_ref, tol_for(t), "causal_softmax_backward");
      Tensor dp2 = dp.clone();
      cpu().causal_softmax_backward(p, dp2, scale, dp2);
      EXPECT_TRUE(bitwise_equal(dp2, ds));
      if (t == DType::F32 && Sk < 100) {
        // The formula is the gradient of sum(dp * softmax): finite differences agree.
        const Vec num = numerical_gradient(
            [&](const Vec& x) { return dot(vdp, causal_softmax_reference(x, Sq, Sk, scale)); }, vs);
        expect_close(ds, num, 1e-5, "causal_softmax_backward vs finite differences");
      }
    }
  }
}

// ---- attention ------------------------------------------------------------------------------

struct AttnShape {
  int64_t B, Hq, Hkv, S, D;
};

struct AttnRef {
  Vec out, lse, dq, dk, dv;
};

// Naive S x S attention in double; with dout, also the analytic backward.
AttnRef attention_reference(const AttnShape& a, const Vec& q, const Vec& k, const Vec& v,
                            double scale, const Vec* dout = nullptr) {
  const int64_t group = a.Hq / a.Hkv, S = a.S, D = a.D;
  AttnRef r;
  r.out.assign(q.size(), 0.0);
  r.lse.assign(static_cast<size_t>(a.B * a.Hq * S), 0.0);
  r.dq.assign(q.size(), 0.0);
  r.dk.assign(k.size(), 0.0);
  r.dv.assign(v.size(), 0.0);
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t h = 0; h < a.Hq; ++h) {
      const int64_t qb = (b * a.Hq + h) * S * D, kb = (b * a.Hkv + h / group) * S * D;
      Vec P(static_cast<size_t>(S * S), 0.0);
      for (int64_t i = 0; i < S; ++i) {
        double mx = -1e300;
        Vec s(static_cast<size_t>(i + 1));
        for (int64_t j = 0; j <= i; ++j) {
          double d = 0;
          for (int64_t c = 0; c < D; ++c) d += q[qb + i * D + c] * k[kb + j * D + c];
          s[j] = scale * d;
          mx = std::max(mx, s[j]);
        }
        double total = 0;
        for (int64_t j = 0; j <= i; ++j) total += std::exp(s[j] - mx);
        r.lse[(b * a.Hq + h) * S + i] = mx + std::log(total);
        for (int64_t j = 0; j <= i; ++j) {
          P[i * S + j] = std::exp(s[j] - mx) / total;
          for (int64_t c = 0; c < D; ++c) r.out[qb + i * D + c] += P[i * S + j] * v[kb + j * D + c];
        }
      }
      if (!dout) continue;
      const Vec& dO = *dout;
      for (int64_t i = 0; i < S; ++i) {
        Vec dP(static_cast<size_t>(i + 1));
        double rowsum = 0;
        for (int64_t j = 0; j <= i; ++j) {
          double d = 0;
          for (int64_t c = 0; c < D; ++c) d += dO[qb + i * D + c] * v[kb + j * D + c];
          dP[j] = d;
          rowsum += P[i * S + j] * d;
        }
        for (int64_t j = 0; j <= i; ++j) {
          const double dS = P[i * S + j] * (dP[j] - rowsum);
          for (int64_t c = 0; c < D; ++c) {
            r.dq[qb + i * D + c] += scale * dS * k[kb + j * D + c];
            r.dk[kb + j * D + c] += scale * dS * q[qb + i * D + c];
            r.dv[kb + j * D + c] += P[i * S + j] * dO[qb + i * D + c];
          }
        }
      }
    }
  return r;
}

TEST(CpuBackend, AttentionReferenceMatchesFiniteDifferences) {
  // Validates the analytic reference backward used by the kernel tests below.
  const AttnShape a{1, 4, 2, 5, 3};
  const double scale = 0.6;
  const Vec q = values(random({a.B, a.Hq, a.S, a.D}, DType::F32, 30));
  const Vec k = values(random({a.B, a.Hkv, a.S, a.D}, DType::F32, 31));
  const Vec v = values(random({a.B, a.Hkv, a.S, a.D}, DType::F32, 32));
  const Vec dO = values(random({a.B, a.Hq, a.S, a.D}, DType::F32, 33));
  const AttnRef r = attention_reference(a, q, k, v, scale, &dO);
  auto loss = [&](const Vec& qq, const Vec& kk, const Vec& vv) {
    return dot(dO, attention_reference(a, qq, kk, vv, scale).out);
  };
  const Vec nq = numerical_gradient([&](const Vec& x) { return loss(x, k, v); }, q);
  const Vec nk = numerical_gradient([&](const Vec& x) { return loss(q, x, v); }, k);
  const Vec nv = numerical_gradient([&](const Vec& x) { return loss(q, k, x); }, v);
  for (size_t i = 0; i < q.size(); ++i) EXPECT_NEAR(r.dq[i], nq[i], 1e-7);
  for (size_t i = 0; i < k.size(); ++i) EXPECT_NEAR(r.dk[i], nk[i], 1e-7);
  for (size_t i = 0; i < v.size(); ++i) EXPECT_NEAR(r.dv[i], nv[i], 1e-7);
}

TEST(CpuBackend, AttentionMatchesNaiveReference) {
  const AttnShape shapes[] = {
      {1, 4, 2, 7, 8},    // grouped-query
      {2, 2, 2, 5, 3},    // one kv head per query head
      {1, 3, 1, 40, 16},  // more keys than one backward key block
  };
  for (const AttnShape& a : shapes) {
    for (DType t : kFloatTypes) {
      SCOPED_TRACE(std::string(dtype_name(t)) + " B=" + std::to_string(a.B) +
                   " Hq=" + std::to_string(a.Hq) + " Hkv=" + std::to_string(a.Hkv) +
                   " S=" + std::to_string(a.S) + " D=" + std::to_string(a.D));
      const float scale = 1.0f / std::sqrt(static_cast<float>(a.D));
      Tensor q = random({a.B, a.Hq, a.S, a.D}, t, 40);
      Tensor k = random({a.B, a.Hkv, a.S, a.D}, t, 41);
      Tensor v = random({a.B, a.Hkv, a.S, a.D}, t, 42);
      Tensor dout = random({a.B, a.Hq, a.S, a.D}, t, 43);
      const Vec vdo = values(dout);
      const AttnRef r = attention_reference(a, values(q), values(k), values(v), scale, &vdo);

      Tensor out = empty({a.B, a.Hq, a.S, a.D}, t), lse = empty({a.B, a.Hq, a.S});
      cpu().attention_forward(q, k, v, scale, out, lse);
      expect_close(out, r.out, tol_for(t), "attention out");
      expect_close(lse, r.lse, 1e-5, "attention lse");

      Tensor dq = empty(q.shape(), t), dk = empty(k.shape(), t), dv = empty(v.shape(), t);
      cpu().attention_backward(q, k, v, out, lse, dout, scale, dq, dk, dv,
                               AttentionBackwardAlgo::Deterministic);
      // 16-bit: the saved output is rounded, which perturbs the softmax row term a little.
      const double tol = t == DType::F32 ? 2e-5 : tol_for(t) * 2;
      expect_close(dq, r.dq, tol, "attention dq");
      expect_close(dk, r.dk, tol, "attention dk");
      expect_close(dv, r.dv, tol, "attention dv");
    }
  }
}

// The same attention composed from gemm (with broadcast kv heads), causal_softmax and their
// backward, all on this backend.
TEST(CpuBackend, AttentionMatchesSoftmaxGemmComposition) {
  const AttnShape a{2, 4, 2, 9, 5};
  const int64_t group = a.Hq / a.Hkv, S = a.S, D = a.D;
  const float scale = 0.45f;
  Tensor q = random({a.B, a.Hq, S, D}, DType::F32, 50);
  Tensor k = random({a.B, a.Hkv, S, D}, DType::F32, 51);
  Tensor v = random({a.B, a.Hkv, S, D}, DType::F32, 52);
  Tensor dout = random({a.B, a.Hq, S, D}, DType::F32, 53);

  Tensor scores = empty({a.B * a.Hq, S, S}), probs = empty({a.B * a.Hq, S, S});
  Tensor out = empty({a.B, a.Hq, S, D});
  Tensor dprobs = empty({a.B * a.Hq, S, S}), dscores = empty({a.B * a.Hq, S, S});
  Tensor dq = empty(q.shape()), dk = empty(k.shape()), dv = empty(v.shape());
  // The query heads of one kv head form a batch that shares (broadcasts) K and V.
  auto group_args = [&](int64_t b, int64_t kvh) {
    GemmArgs g;
    g.batch = group;
    g.offset_a = (b * a.Hq + kvh * group) * S * D;
    g.offset_b = (b * a.Hkv + kvh) * S * D;
    return g;
  };
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t kvh = 0; kvh < a.Hkv; ++kvh) {
      GemmArgs g = group_args(b, kvh);  // scores = Q K^T
      g.trans_b = true;
      g.m = S, g.n = S, g.k = D;
      g.stride_a = S * D, g.stride_b = 0, g.stride_c = S * S;
      g.offset_c = (b * a.Hq + kvh * group) * S * S;
      cpu().gemm(g, q, k, scores);
    }
  cpu().causal_softmax(scores, scale, probs);
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t kvh = 0; kvh < a.Hkv; ++kvh) {
      GemmArgs g = group_args(b, kvh);  // out = P V
      g.m = S, g.n = D, g.k = S;
      g.offset_c = g.offset_a;
      g.offset_a = (b * a.Hq + kvh * group) * S * S;
      g.stride_a = S * S, g.stride_b = 0, g.stride_c = S * D;
      cpu().gemm(g, probs, v, out);
      GemmArgs gd = group_args(b, kvh);  // dP = dO V^T
      gd.trans_b = true;
      gd.m = S, gd.n = S, gd.k = D;
      gd.stride_a = S * D, gd.stride_b = 0, gd.stride_c = S * S;
      gd.offset_c = (b * a.Hq + kvh * group) * S * S;
      cpu().gemm(gd, dout, v, dprobs);
    }
  cpu().causal_softmax_backward(probs, dprobs, scale, dscores);
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t h = 0; h < a.Hq; ++h) {
      const int64_t kvh = h / group, qoff = (b * a.Hq + h) * S * D,
                    koff = (b * a.Hkv + kvh) * S * D, soff = (b * a.Hq + h) * S * S;
      GemmArgs g;  // dQ = dS K
      g.m = S, g.n = D, g.k = S;
      g.offset_a = soff, g.offset_b = koff, g.offset_c = qoff;
      cpu().gemm(g, dscores, k, dq);
      const float beta = h % group == 0 ? 0.0f : 1.0f;  // sum over the group's query heads
      GemmArgs gk;                                      // dK += dS^T Q
      gk.trans_a = true;
      gk.m = S, gk.n = D, gk.k = S, gk.beta = beta;
      gk.offset_a = soff, gk.offset_b = qoff, gk.offset_c = koff;
      cpu().gemm(gk, dscores, q, dk);
      GemmArgs gv = gk;  // dV += P^T dO
      cpu().gemm(gv, probs, dout, dv);
    }

  Tensor fout = empty(out.shape()), lse = empty({a.B, a.Hq, S});
  cpu().attention_forward(q, k, v, scale, fout, lse);
  expect_close(fout, values(out), 1e-5, "fused vs composed out");
  Tensor fdq = empty(q.shape()), fdk = empty(k.shape()), fdv = empty(v.shape());
  cpu().attention_backward(q, k, v, fout, lse, dout, scale, fdq, fdk, fdv,
                           AttentionBackwardAlgo::Deterministic);
  expect_close(fdq, values(dq), 2e-5, "fused vs composed dq");
  expect_close(fdk, values(dk), 2e-5, "fused vs composed dk");
  expect_close(fdv, values(dv), 2e-5, "fused vs composed dv");
}

TEST(CpuBackend, AttentionBackwardIsDeterministic) {
  const AttnShape a{2, 4, 2, 70, 16};
  Tensor q = random({a.B, a.Hq, a.S, a.D}, DType::BF16, 60);
  Tensor k = random({a.B, a.Hkv, a.S, a.D}, DType::BF16, 61);
  Tensor v = random({a.B, a.Hkv, a.S, a.D}, DType::BF16, 62);
  Tensor dout = random({a.B, a.Hq, a.S, a.D}, DType::BF16, 63);
  Tensor out = empty(q.shape(), DType::BF16), lse = empty({a.B, a.Hq, a.S});
  cpu().attention_forward(q, k, v, 0.25f, out, lse);
  auto run = [&](int threads) {
    std::vector<Tensor> grads = {empty(q.shape(), DType::F32), empty(k.shape(), DType::F32),
                                 empty(v.shape(), DType::F32)};
    with_threads(threads, [&] {
      cpu().attention_backward(q, k, v, out, lse, dout, 0.25f, grads[0], grads[1], grads[2],
                               AttentionBackwardAlgo::Deterministic);
    });
    return grads;
  };
  const auto first = run(2), second = run(2), single = run(1), many = run(3);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(bitwise_equal(first[i], second[i])) << i;
    EXPECT_TRUE(bitwise_equal(first[i], single[i])) << i;
    EXPECT_TRUE(bitwise_equal(first[i], many[i])) << i;
  }
}

// ---- swiglu ---------------------------------------------------------------------------------

double silu(double x) {
  return x / (1.0 + std::exp(-x));
}

TEST(CpuBackend, SwiGluForwardAndBackward) {
  for (const Shape& shape : {Shape{3, 5, 7}, Shape{17, 33, 5}}) {
    for (DType t : kFloatTypes) {
      SCOPED_TRACE(std::string(dtype_name(t)) + shape_str(shape));
      Tensor gate = random(shape, t, 70, 3.0f), up = random(shape, t, 71),
             dout = random(shape, t, 72);
      const Vec g = values(gate), u = values(up), d = values(dout);
      Vec out_ref(g.size()), dg_ref(g.size()), du_ref(g.size());
      const double h = 1e-6;
      for (size_t i = 0; i < g.size(); ++i) {
        out_ref[i] = silu(g[i]) * u[i];
        dg_ref[i] = d[i] * u[i] * (silu(g[i] + h) - silu(g[i] - h)) / (2 * h);
        du_ref[i] = d[i] * silu(g[i]);
      }
      Tensor out = empty(shape, t), dg = empty(shape, t), du = empty(shape, t);
      cpu().swiglu_forward(gate, up, out);
      expect_close(out, out_ref, tol_for(t), "swiglu");
      cpu().swiglu_backward(dout, gate, up, dg, du);
      expect_close(dg, dg_ref, std::max(tol_for(t), 1e-5), "swiglu dgate");
      expect_close(du, du_ref, tol_for(t), "swiglu dup");
    }
  }
}

// ---- cross-entropy --------------------------------------------------------------------------

TEST(CpuBackend, CrossEntropyWithIgnoredRows) {
  const float grad_scale = 0.25f;
  const std::pair<int64_t, int64_t> sizes[] = {{6, 37}, {4, 2000}};
  for (const auto& [N, V] : sizes) {
    for (DType t : kFloatTypes) {
      SCOPED_TRACE(std::string(dtype_name(t)) + " N=" + std::to_string(N) +
                   " V=" + std::to_string(V));
      Tensor logits = random({N, V}, t, 80, 4.0f);
      std::vector<int64_t> tv(N);
      for (int64_t i = 0; i < N; ++i) tv[i] = (i * 7 + 3) % V;
      tv[1] = -100;
      tv[N - 1] = -100;
      Tensor targets = from_ints(tv, {N});
      const Vec x = values(logits);
      Vec loss_ref(N, 0.0), grad_ref(x.size(), 0.0);
      for (int64_t i = 0; i < N; ++i) {
        if (tv[i] == -100) continue;
        double mx = -1e300, total = 0;
        for (int64_t j = 0; j < V; ++j) mx = std::max(mx, x[i * V + j]);
        for (int64_t j = 0; j < V; ++j) total += std::exp(x[i * V + j] - mx);
        loss_ref[i] = mx + std::log(total) - x[i * V + tv[i]];
        for (int64_t j = 0; j < V; ++j)
          grad_ref[i * V + j] =
              grad_scale * (std::exp(x[i * V + j] - mx) / total - (j == tv[i] ? 1.0 : 0.0));
      }
      Tensor losses = empty({N}), dlogits = full({N, V}, 9.0f, t);
      cpu().cross_entropy_forward(logits, targets, losses);
      expect_close(losses, loss_ref, 1e-5, "cross_entropy loss");
      EXPECT_EQ(losses.to_float_vector()[1], 0.0f);
      cpu().cross_entropy_backward(logits, targets, grad_scale, dlogits);
      expect_close(dlogits, grad_ref, tol_for(t), "cross_entropy grad");
      const Vec dl = values(dlogits);
      for (int64_t j = 0; j < V; ++j) ASSERT_EQ(dl[1 * V + j], 0.0);  // ignored row
      if (t == DType::F32 && V < 100) {
        // The gradient is the derivative of grad_scale * sum(loss).
        auto total_loss = [&](const Vec& xs) {
          double s = 0;
          for (int64_t i = 0; i < N; ++i) {
            if (tv[i] == -100) continue;
            double acc = 0;
            for (int64_t j = 0; j < V; ++j) acc += std::exp(xs[i * V + j]);
            s += std::log(acc) - xs[i * V + tv[i]];
          }
          return grad_scale * s;
        };
        expect_close(dlogits, numerical_gradient(total_loss, x), 1e-5, "cross_entropy vs fd");
      }
    }
  }
}

TEST(CpuBackend, CrossEntropyIsStableForLargeLogitsAndChecksTargets) {
  Tensor logits = from_floats({1000.0f, 1001.0f, 999.0f, -1000.0f}, {2, 2});
  Tensor targets = from_ints({1, 0}, {2});
  Tensor losses = empty({2}), grad = empty({2, 2});
  cpu().cross_entropy_forward(logits, targets, losses);
  cpu().cross_entropy_backward(logits, targets, 1.0f, grad);
  const std::vector<float> l = losses.to_float_vector();
  EXPECT_NEAR(l[0], std::log(1.0 + std::exp(-1.0)), 1e-6);
  EXPECT_NEAR(l[1], 0.0, 1e-6);
  for (float g : grad.to_float_vector()) EXPECT_TRUE(std::isfinite(g));
  EXPECT_THROW(cpu().cross_entropy_forward(logits, from_ints({2, 0}, {2}), losses), ShapeError);
  EXPECT_THROW(cpu().cross_entropy_forward(logits, from_ints({-1, 0}, {2}), losses), ShapeError);
}

// ---- reductions, loss scaling, optimizer ----------------------------------------------------

TEST(CpuBackend, SumAndSumSquaresAreExactAndDeterministic) {
  for (DType t : kFloatTypes) {
    Tensor x = random({5001}, t, 90, 2.0f);
    double s = 0, ss = 0, mag = 0;
    for (double v : values(x)) {
      s += v;
      ss += v * v;
      mag += std::fabs(v);
    }
    EXPECT_NEAR(cpu().sum(x), s, 1e-12 * mag) << dtype_name(t);
    EXPECT_NEAR(cpu().sum_squares(x), ss, 1e-12 * ss) << dtype_name(t);
    double one = 0, three = 0;
    with_threads(1, [&] { one = cpu().sum(x); });
    with_threads(3, [&] { three = cpu().sum(x); });
    EXPECT_EQ(one, three);
    EXPECT_EQ(one, cpu().sum(x));
  }
  EXPECT_EQ(cpu().sum(empty({0})), 0.0);
}

TEST(CpuBackend, UnscaleAndCheck) {
  for (DType t : kFloatTypes) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    Tensor x = random({3000}, t, 91);
    const Vec before = values(x);
    EXPECT_FALSE(cpu().unscale_and_check(x, 0.25f));
    const Vec after = values(x);
    for (size_t i = 0; i < before.size(); ++i)
      ASSERT_EQ(after[i], round_to(t, static_cast<float>(before[i]) * 0.25f)) << i;

    for (float bad :
         {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
          std::numeric_limits<float>::quiet_NaN()}) {
      std::vector<float> v(3000, 2.0f);
      v[2500] = bad;  // in a later chunk
      Tensor y = from_floats(v, {3000}, t);
      EXPECT_TRUE(cpu().unscale_and_check(y, 0.5f)) << bad;
      EXPECT_EQ(y.to_float_vector()[0], 1.0f);
    }
  }
}

TEST(CpuBackend, AdamWMatchesScalarReferenceForThreeSteps) {
  const Backend::AdamWArgs base{1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, 1};
  const int64_t n = 3001;
  for (DType gt : kFloatTypes) {
    SCOPED_TRACE(std::string(dtype_name(gt)));
    Tensor p = random({n}, DType::F32, 100), m = zeros({n}), v = zeros({n});
    Vec rp = values(p), rm(n, 0.0), rv(n, 0.0);
    for (int64_t step = 1; step <= 3; ++step) {
      Tensor g = random({n}, gt, 100 + static_cast<uint64_t>(step), 0.5f);
      const Vec vg = values(g);
      Backend::AdamWArgs args = base;
      args.step = step;
      cpu().adamw(p, g, m, v, args);
      const double b1 = args.beta1, b2 = args.beta2, lr = args.lr;
      for (int64_t i = 0; i < n; ++i) {
        rp[i] -= lr * args.weight_decay * rp[i];
        rm[i] = b1 * rm[i] + (1 - b1) * vg[i];
        rv[i] = b2 * rv[i] + (1 - b2) * vg[i] * vg[i];
        rp[i] -= lr * (rm[i] / (1 - std::pow(b1, step))) /
                 (std::sqrt(rv[i] / (1 - std::pow(b2, step))) + args.eps);
      }
      expect_close(m, rm, 1e-5, "adamw m step " + std::to_string(step));
      expect_close(v, rv, 1e-5, "adamw v step " + std::to_string(step));
      const Vec got = values(p);
      for (int64_t i = 0; i < n; ++i)
        ASSERT_NEAR(got[i], rp[i], 1e-6) << "param " << i << " step " << step;
    }
  }
}

// grad_scale (global-norm clipping's factor) is the step on the gradient scaled first: bit for bit
// that of an fp32 gradient holding the products. 16-bit gradients are scaled after widening, never
// rounded back to 16 bits. The gradient itself is left as it was.
TEST(CpuBackend, AdamWGradScaleIsTheStepOnTheScaledGradient) {
  const int64_t n = 3001;
  const float factor = 0.37f;
  for (DType gt : kFloatTypes) {
    SCOPED_TRACE(std::string(dtype_name(gt)));
    Tensor g = random({n}, gt, 700, 0.5f);
    const std::vector<float> before = g.to_float_vector();
    std::vector<float> products = before;
    for (float& x : products) x *= factor;
    const Tensor scaled = from_floats(products, {n});
    Tensor p = random({n}, DType::F32, 701), m = random({n}, DType::F32, 702, 0.1f);
    std::vector<float> squares = random({n}, DType::F32, 703, 0.1f).to_float_vector();
    for (float& x : squares) x *= x;
    Tensor v = from_floats(squares, {n});
    Tensor rp = p.clone(), rm = m.clone(), rv = v.clone(), unclipped = p.clone();
    Tensor um = m.clone(), uv = v.clone();
    Backend::AdamWArgs args{1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, 2};
    cpu().adamw(unclipped, g, um, uv, args);
    args.grad_scale = factor;
    cpu().adamw(p, g, m, v, args);
    args.grad_scale = 1.0f;
    cpu().adamw(rp, scaled, rm, rv, args);
    EXPECT_EQ(p.to_float_vector(), rp.to_float_vector());
    EXPECT_EQ(m.to_float_vector(), rm.to_float_vector());
    EXPECT_EQ(v.to_float_vector(), rv.to_float_vector());
    EXPECT_NE(p.to_float_vector(), unclipped.to_float_vector()) << "the factor changed nothing";
    EXPECT_EQ(g.to_float_vector(), before);
  }
}

// The list forms of sum_squares and unscale_and_check are the per-tensor calls.
TEST(CpuBackend, SumSquaresAndUnscaleOverLists) {
  std::vector<Tensor> xs;
  for (int i = 0; i < 5; ++i)
    xs.push_back(random({7 + 300 * i}, kFloatTypes[i % 3], 600 + static_cast<uint64_t>(i)));
  std::vector<const Tensor*> list;
  for (const Tensor& x : xs) list.push_back(&x);
  const std::vector<double> sums = cpu().sum_squares_multi(list);
  ASSERT_EQ(sums.size(), xs.size());
  for (size_t i = 0; i < xs.size(); ++i) EXPECT_EQ(sums[i], cpu().sum_squares(xs[i]));

  std::vector<Tensor> want;
  for (const Tensor& x : xs) want.push_back(x.clone());
  std::vector<float> bad = xs[3].to_float_vector();
  bad[5] = std::numeric_limits<float>::quiet_NaN();
  xs[3] = from_floats(bad, xs[3].shape(), xs[3].dtype());
  want[3] = xs[3].clone();
  std::vector<Tensor*> pointers;
  for (Tensor& x : xs) pointers.push_back(&x);
  EXPECT_TRUE(cpu().unscale_and_check_multi(pointers, 0.5f));
  for (size_t i = 0; i < xs.size(); ++i) {
    EXPECT_EQ(cpu().unscale_and_check(want[i], 0.5f), i == 3);
    const std::vector<float> got = xs[i].to_float_vector(), expected = want[i].to_float_vector();
    for (size_t j = 0; j < got.size(); ++j) {
      if (std::isnan(got[j]) && std::isnan(expected[j])) continue;
      ASSERT_EQ(got[j], expected[j]) << "tensor " << i << " element " << j;
    }
  }
  pointers.erase(pointers.begin() + 3);
  EXPECT_FALSE(cpu().unscale_and_check_multi(pointers, 0.5f));
}

// The list form applies the decay flag per entry and is otherwise the per-tensor step.
TEST(CpuBackend, AdamWMultiIsThePerTensorStepWithDecayPerEntry) {
  const Backend::AdamWArgs args{1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, 2};
  std::vector<Tensor> p, m, v, g, rp, rm, rv;
  std::vector<Backend::AdamWTensor> list;
  for (int i = 0; i < 6; ++i) {
    const int64_t n = 17 + 500 * i;
    p.push_back(random({n}, DType::F32, 400 + static_cast<uint64_t>(i)));
    m.push_back(random({n}, DType::F32, 410 + static_cast<uint64_t>(i), 0.1f));
    std::vector<float> squares =
        random({n}, DType::F32, 420 + static_cast<uint64_t>(i), 0.1f).to_float_vector();
    for (float& x : squares) x *= x;  // a second moment is never negative
    v.push_back(from_floats(squares, {n}));
    g.push_back(random({n}, kFloatTypes[i % 3], 430 + static_cast<uint64_t>(i)));
    rp.push_back(p.back().clone());
    rm.push_back(m.back().clone());
    rv.push_back(v.back().clone());
  }
  for (size_t i = 0; i < p.size(); ++i) list.push_back({&p[i], &g[i], &m[i], &v[i], i % 2 == 0});
  cpu().adamw_multi(list, args);
  for (size_t i = 0; i < p.size(); ++i) {
    Backend::AdamWArgs own = args;
    if (i % 2 != 0) own.weight_decay = 0.0f;
    cpu().adamw(rp[i], g[i], rm[i], rv[i], own);
    for (auto [got, want] : {std::pair{&p[i], &rp[i]}, {&m[i], &rm[i]}, {&v[i], &rv[i]}})
      EXPECT_EQ(got->to_float_vector(), want->to_float_vector()) << "entry " << i;
  }
}

}  // namespace
}  // namespace shardtrain
