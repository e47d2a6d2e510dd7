// Every non-matmul, non-attention kernel of the CUDA backend against the CPU backend, on random
// inputs of several shapes (including ones that are not multiples of any vector or tile width)
// and every float dtype.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "cuda_test_util.h"

namespace shardtrain {
namespace {

using testing::cpu;
using testing::cuda0;
using testing::expect_close;
using testing::expect_close_scaled;
using testing::gpu;
using testing::random_cpu;
using testing::tolerance;

constexpr DType kFloatTypes[] = {DType::F32, DType::BF16, DType::F16};

std::string label(const char* op, DType t, const Shape& s) {
  return std::string(op) + " " + std::string(dtype_name(t)) + shape_str(s);
}

TEST(CudaKernels, FillAndCast) {
  REQUIRE_CUDA();
  for (DType t : {DType::F32, DType::BF16, DType::F16, DType::I32, DType::I64, DType::U8}) {
    for (int64_t n : {1, 7, 1000, 4099}) {
      Tensor g = empty({n}, t, cuda0());
      gpu().fill(g, 3.0f);
      Tensor c = empty({n}, t, Device::cpu());
      cpu().fill(c, 3.0f);
      testing::expect_bitwise_equal(g, c, label("fill", t, {n}));
    }
  }
  // Casts between every pair of dtypes, including integers.
  const DType all[] = {DType::F32, DType::BF16, DType::F16, DType::I32, DType::I64, DType::U8};
  for (DType from : all) {
    for (DType to : all) {
      const Shape shape{3, 37};
      Generator gen(11);
      Tensor src = rand_uniform(shape, gen, 0.0f, 100.0f, DType::F32).to(from);
      Tensor want = empty(shape, to);
      cpu().cast(src, want);
      Tensor got = empty(shape, to, cuda0());
      gpu().cast(src.to(cuda0()), got);
      testing::expect_bitwise_equal(
          got, want, std::string("cast ") + testing::name(from) + " -> " + testing::name(to));
    }
  }
}

TEST(CudaKernels, AddMulScale) {
  REQUIRE_CUDA();
  for (DType ta : kFloatTypes) {
    for (DType tb : kFloatTypes) {
      for (DType to : kFloatTypes) {
        for (int64_t n : {1, 5, 1027, 70001}) {
          const Shape s{n};
          Tensor a = random_cpu(s, ta, 1), b = random_cpu(s, tb, 2);
          Tensor ga = a.to(cuda0()), gb = b.to(cuda0());
          Tensor want = empty(s, to), got = empty(s, to, cuda0());
          cpu().add(a, b, want, 0.5f, -2.0f);
          gpu().add(ga, gb, got, 0.5f, -2.0f);
          expect_close(got, want, 1e-6f, tolerance(to), label("add", to, s));
          cpu().mul(a, b, want);
          gpu().mul(ga, gb, got);
          expect_close(got, want, 1e-6f, 1e-6f, label("mul", to, s));
        }
      }
      const Shape s{333};
      Tensor a = random_cpu(s, ta, 3);
      Tensor want = empty(s, tb), got = empty(s, tb, cuda0());
      cpu().scale(a, want, -1.5f);
      gpu().scale(a.to(cuda0()), got, -1.5f);
      expect_close(got, want, 1e-6f, 1e-6f, label("scale", tb, s));
    }
  }
  // In place (out aliases a) on an offset view, so vectors are misaligned.
  Tensor base = random_cpu({2, 1001}, DType::BF16, 4);
  Tensor g = base.to(cuda0());
  Tensor gv = g.slice_rows(1, 1).view({1001}), cv = base.slice_rows(1, 1).view({1001});
  Tensor other = random_cpu({1001}, DType::F32, 5);
  gpu().add(gv, other.to(cuda0()), gv, 1.0f, 3.0f);
  cpu().add(cv, other, cv, 1.0f, 3.0f);
  expect_close(g, base, 0.0f, tolerance(DType::BF16), "in-place add on a view");
}

TEST(CudaKernels, MulLastdimAndWeightGradient) {
  REQUIRE_CUDA();
  for (DType t : kFloatTypes) {
    for (Shape s : {Shape{4, 64}, Shape{3, 7, 33}, Shape{300, 4096}, Shape{1, 1}}) {
      const int64_t w_n = s.back();
      Tensor x = random_cpu(s, t, 6), w = random_cpu({w_n}, DType::F32, 7);
      Tensor want = empty(s, t), got = empty(s, t, cuda0());
      cpu().mul_lastdim(x, w, want);
      gpu().mul_lastdim(x.to(cuda0()), w.to(cuda0()), got);
      expect_close(got, want, 1e-6f, 1e-6f, label("mul_lastdim", t, s));

      Tensor dy = random_cpu(s, t, 8);
      Tensor gw_want = random_cpu({w_n}, DType::F32, 9);  // accumulates into existing values
      Tensor gw_got = gw_want.to(cuda0());
      cpu().mul_lastdim_backward_weight(dy, x, gw_want);
      gpu().mul_lastdim_backward_weight(dy.to(cuda0()), x.to(cuda0()), gw_got);
      expect_close_scaled(gw_got, gw_want, 1e-5f, label("mul_lastdim_backward_weight", t, s));
    }
  }
}

TEST(CudaKernels, Permute0213) {
  REQUIRE_CUDA();
  for (DType t : {DType::F32, DType::BF16, DType::I64}) {
    for (Shape s : {Shape{2, 3, 4, 64}, Shape{1, 5, 3, 7}, Shape{3, 17, 2, 1}}) {
      Generator gen(12);
      Tensor x = rand_uniform(s, gen, -50.0f, 50.0f, DType::F32).to(t);
      const Shape o{s[0], s[2], s[1], s[3]};
      Tensor want = empty(o, t), got = empty(o, t, cuda0());
      cpu().permute_0213(x, want);
      gpu().permute_0213(x.to(cuda0()), got);
      testing::expect_bitwise_equal(got, want, label("permute_0213", t, s));
    }
  }
  // Output dtype differing from the input.
  Tensor x = random_cpu({2, 3, 5, 8}, DType::F32, 13);
  Tensor want = empty({2, 5, 3, 8}, DType::BF16), got = empty({2, 5, 3, 8}, DType::BF16, cuda0());
  cpu().permute_0213(x, want);
  gpu().permute_0213(x.to(cuda0()), got);
  testing::expect_bitwise_equal(got, want, "permute_0213 f32 -> bf16");
}

TEST(CudaKernels, Embedding) {
  REQUIRE_CUDA();
  for (DType t : kFloatTypes) {
    for (auto [V, H, N] : {std::tuple<int64_t, int64_t, int64_t>{50, 64, 200},
                           {7, 33, 19},
                           {1000, 256, 4096},
                           {3, 8, 1}}) {
      Tensor w = random_cpu({V, H}, t, 14);
      // Many repeats (small vocab relative to tokens) exercise the ordered per-id sums.
      Tensor ids = from_ints(testing::random_ids(N, V, 15), {N});
      Tensor want = empty({N, H}, t), got = empty({N, H}, t, cuda0());
      cpu().embedding_forward(w, ids, want);
      gpu().embedding_forward(w.to(cuda0()), ids.to(cuda0()), got);
      testing::expect_bitwise_equal(got, want, label("embedding_forward", t, {V, H, N}));

      Tensor dy = random_cpu({N, H}, t, 16);
      Tensor gw_want = random_cpu({V, H}, DType::F32, 17);
      Tensor gw_got = gw_want.to(cuda0());
      cpu().embedding_backward(dy, ids, gw_want);
      gpu().embedding_backward(dy.to(cuda0()), ids.to(cuda0()), gw_got);
      expect_close(gw_got, gw_want, 2e-5f, 2e-5f, label("embedding_backward", t, {V, H, N}));
      // Deterministic: a second run from the same start gives the same bits.
      Tensor again = random_cpu({V, H}, DType::F32, 17).to(cuda0());
      gpu().embedding_backward(dy.to(cuda0()), ids.to(cuda0()), again);
      testing::expect_bitwise_equal(again, gw_got, "embedding_backward determinism");
    }
  }
  // Mixed dtypes: bf16 table into an f32 output.
  Tensor w = random_cpu({10, 12}, DType::BF16, 18);
  Tensor ids = from_ints({9, 0, 3}, {3});
  Tensor want = empty({3, 12}, DType::F32), got = empty({3, 12}, DType::F32, cuda0());
  cpu().embedding_forward(w, ids, want);
  gpu().embedding_forward(w.to(cuda0()), ids.to(cuda0()), got);
  testing::expect_bitwise_equal(got, want, "embedding bf16 -> f32");
}

TEST(CudaKernels, EmbeddingRejectsOutOfRangeIds) {
  REQUIRE_CUDA();
  Tensor w = zeros({10, 4}, DType::F32, cuda0());
  Tensor ids = from_ints({1, 2, 12, 3}, {4}, DType::I64, cuda0());
  Tensor out = empty({4, 4}, DType::F32, cuda0());
  try {
    gpu().embedding_forward(w, ids, out);
    FAIL() << "expected ShapeError";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("token id 12 at position 2 is outside [0, 10)"),
              std::string::npos)
        << e.what();
  }
}

TEST(CudaKernels, RmsNorm) {
  REQUIRE_CUDA();
  for (DType t : kFloatTypes) {
    for (DType tw : {DType::F32, t}) {
      // 12040 columns: too wide for the fused backward's weight-gradient row in shared memory,
      // so the two-pass backward.
      for (Shape s :
           {Shape{4, 64}, Shape{3, 5, 37}, Shape{33, 4096}, Shape{2, 1}, Shape{2, 12040}}) {
        const int64_t H = s.back(), N = numel(s) / H;
        Tensor x = random_cpu(s, t, 20), w = random_cpu({H}, tw, 21, 0.5f);
        Tensor y_want = empty(s, t), r_want = empty({N});
        Tensor y_got = empty(s, t, cuda0()), r_got = empty({N}, DType::F32, cuda0());
        cpu().rmsnorm_forward(x, w, 1e-5f, y_want, r_want);
        gpu().rmsnorm_forward(x.to(cuda0()), w.to(cuda0()), 1e-5f, y_got, r_got);
        expect_close(r_got, r_want, 0.0f, 1e-5f, label("rmsnorm rstd", t, s));
        expect_close(y_got, y_want, 1e-5f, tolerance(t), label("rmsnorm y", t, s));

        Tensor dy = random_cpu(s, t, 22);
        Tensor dx_want = empty(s, t), dw_want = random_cpu({H}, DType::F32, 23);
        Tensor dx_got = empty(s, t, cuda0()), dw_got = dw_want.to(cuda0());
        cpu().rmsnorm_backward(dy, x, w, r_want, dx_want, dw_want);
        gpu().rmsnorm_backward(dy.to(cuda0()), x.to(cuda0()), w.to(cuda0()), r_want.to(cuda0()),
                               dx_got, dw_got);
        // Unit floor: with H = 1, dx = rstd w dy eps rstd^2 is what is left of two equal terms.
        expect_close_scaled(dx_got, dx_want, 2 * tolerance(t), label("rmsnorm dx", t, s), 1.0f);
        expect_close_scaled(dw_got, dw_want, 1e-5f, label("rmsnorm dw", t, s));
      }
    }
  }
  {
    // 16411 rows: the fused backward's 1024 blocks take runs of 17 rows, the last one 4.
    const Shape s{16411, 8};
    Tensor x = random_cpu(s, DType::BF16, 27), w = random_cpu({8}, DType::F32, 28, 0.5f);
    Tensor y = empty(s, DType::BF16), r = empty({16411});
    cpu().rmsnorm_forward(x, w, 1e-5f, y, r);
    Tensor dy = random_cpu(s, DType::BF16, 29);
    Tensor dx_want = empty(s, DType::BF16), dw_want = zeros({8});
    cpu().rmsnorm_backward(dy, x, w, r, dx_want, dw_want);
    Tensor dx = empty(s, DType::BF16, cuda0()), dw = zeros({8}, DType::F32, cuda0());
    gpu().rmsnorm_backward(dy.to(cuda0()), x.to(cuda0()), w.to(cuda0()), r.to(cuda0()), dx, dw);
    expect_close_scaled(dx, dx_want, 2 * tolerance(DType::BF16), "rmsnorm dx, 16411 rows", 1.0f);
    expect_close_scaled(dw, dw_want, 1e-5f, "rmsnorm dw, 16411 rows");
  }
  // dx may share memory with dy.
  Tensor x = random_cpu({8, 48}, DType::F32, 24), w = random_cpu({48}, DType::F32, 25);
  Tensor r = empty({8}), y = empty({8, 48});
  cpu().rmsnorm_forward(x, w, 1e-6f, y, r);
  Tensor dy = random_cpu({8, 48}, DType::F32, 26);
  Tensor dx_want = empty({8, 48}), dw_want = zeros({48});
  cpu().rmsnorm_backward(dy, x, w, r, dx_want, dw_want);
  Tensor g = dy.to(cuda0()), dw = zeros({48}, DType::F32, cuda0());
  gpu().rmsnorm_backward(g, x.to(cuda0()), w.to(cuda0()), r.to(cuda0()), g, dw);
  expect_close_scaled(g, dx_want, 1e-5f, "rmsnorm dx aliasing dy");
  expect_close_scaled(dw, dw_want, 1e-5f, "rmsnorm dw with aliasing");
}

TEST(CudaKernels, Rope) {
  REQUIRE_CUDA();
  for (DType t : kFloatTypes) {
    for (Shape s : {Shape{2, 17, 3, 64}, Shape{1, 300, 2, 128}, Shape{1, 5, 1, 6}}) {
      for (bool inverse : {false, true}) {
        Tensor x = random_cpu(s, t, 30);
        Tensor want = empty(s, t), got = empty(s, t, cuda0());
        cpu().rope(x, want, RopeParams{10000.0f}, 7, inverse);
        gpu().rope(x.to(cuda0()), got, RopeParams{10000.0f}, 7, inverse);
        expect_close(got, want, 2e-5f, tolerance(t), label("rope", t, s));
      }
    }
  }
  // Far positions: equal angles need equal inverse frequencies (an ulp of difference moves the
  // angle at position 131000 by about 0.01 rad); and a head dim past the host-side table.
  for (auto [s, offset] :
       {std::pair<Shape, int64_t>{Shape{1, 4, 2, 128}, 131000}, {Shape{1, 3, 1, 1030}, 7}}) {
    Tensor x = random_cpu(s, DType::F32, 32);
    Tensor want = empty(s), got = empty(s, DType::F32, cuda0());
    cpu().rope(x, want, RopeParams{500000.0f}, offset, false);
    gpu().rope(x.to(cuda0()), got, RopeParams{500000.0f}, offset, false);
    expect_close(got, want, 2e-5f, 2e-5f, label("rope far positions", DType::F32, s));
  }
  // In place on a view one element into its storage, so the vector path's loads would be
  // misaligned: the kernel must take the one-pair path.
  {
    Tensor base = random_cpu({385, 1}, DType::BF16, 34);
    Tensor g = base.to(cuda0());
    Tensor gv = g.slice_rows(1, 384).view({1, 3, 2, 64});
    Tensor cv = base.slice_rows(1, 384).view({1, 3, 2, 64});
    gpu().rope(gv, gv, RopeParams{10000.0f}, 3, false);
    cpu().rope(cv, cv, RopeParams{10000.0f}, 3, false);
    expect_close(g, base, 2e-5f, tolerance(DType::BF16), "rope in place on a misaligned view");
  }
  // In place, and forward then inverse is the identity.
  Tensor x = random_cpu({2, 9, 2, 32}, DType::F32, 31);
  Tensor g = x.to(cuda0());
  gpu().rope(g, g, RopeParams{500000.0f}, 100, false);
  gpu().rope(g, g, RopeParams{500000.0f}, 100, true);
  expect_close(g, x, 1e-5f, 1e-5f, "rope round trip");
}

TEST(CudaKernels, RopeWithLlama3Scaling) {
  REQUIRE_CUDA();
  // Llama-3.1 scaling on head dims 64 and 128 (frequencies in the kernel's parameters), and on
  // 1030 and 2050, past the parameter table, where the host's frequencies are copied to the
  // device: the same fp32 angles as the CPU's at near and far positions.
  const Llama3RopeScaling llama31{8.0, 1.0, 4.0, 8192};
  for (DType t : kFloatTypes) {
    for (Shape s : {Shape{2, 17, 3, 64}, Shape{1, 300, 2, 128}, Shape{1, 3, 1, 1030}}) {
      for (bool inverse : {false, true}) {
        Tensor x = random_cpu(s, t, 33);
        Tensor want = empty(s, t), got = empty(s, t, cuda0());
        cpu().rope(x, want, RopeParams{500000.0f, llama31}, 7, inverse);
        gpu().rope(x.to(cuda0()), got, RopeParams{500000.0f, llama31}, 7, inverse);
        expect_close(got, want, 2e-5f, tolerance(t), label("scaled rope", t, s));
      }
    }
  }
  for (auto [s, offset] :
       {std::pair<Shape, int64_t>{Shape{1, 4, 2, 128}, 131000}, {Shape{1, 3, 1, 2050}, 60000}}) {
    Tensor x = random_cpu(s, DType::F32, 34);
    Tensor want = empty(s), got = empty(s, DType::F32, cuda0());
    cpu().rope(x, want, RopeParams{500000.0f, llama31}, offset, false);
    gpu().rope(x.to(cuda0()), got, RopeParams{500000.0f, llama31}, offset, false);
    expect_close(got, want, 2e-5f, 2e-5f, label("scaled rope far positions", DType::F32, s));
  }
  // In place, and forward then inverse is the identity, past the parameter table too.
  for (Shape s : {Shape{2, 9, 2, 32}, Shape{1, 5, 2, 1030}}) {
    Tensor x = random_cpu(s, DType::F32, 35);
    Tensor g = x.to(cuda0());
    gpu().rope(g, g, RopeParams{500000.0f, llama31}, 100, false);
    gpu().rope(g, g, RopeParams{500000.0f, llama31}, 100, true);
    expect_close(g, x, 1e-5f, 1e-5f, label("scaled rope round trip", DType::F32, s));
  }
  // Unusable scaling is an error, not a plain rotation.
  Tensor x = random_cpu({1, 2, 1, 8}, DType::F32, 36).to(cuda0());
  EXPECT_THROW(gpu().rope(x, x, RopeParams{1e4f, Llama3RopeScaling{8.0, 4.0, 1.0, 8}}, 0, false),
               ConfigError);
}

TEST(CudaKernels, CausalSoftmax) {
  REQUIRE_CUDA();
  for (DType t : kFloatTypes) {
    // [N, Sq, Sk] with Sk >= Sq (keys include a prefix) and a few ragged lengths.
    for (Shape s :
         {Shape{2, 16, 16}, Shape{3, 5, 9}, Shape{1, 33, 33}, Shape{2, 7, 1030}, Shape{1, 4, 2}}) {
      Tensor x = random_cpu(s, t, 40, 3.0f);
      Tensor want = empty(s, t), got = empty(s, t, cuda0());
      cpu().causal_softmax(x, 0.7f, want);
      gpu().causal_softmax(x.to(cuda0()), 0.7f, got);
      expect_close(got, want, 1e-6f, tolerance(t), label("causal_softmax", t, s));

      Tensor dp = random_cpu(s, t, 41);
      Tensor ds_want = empty(s, t), ds_got = empty(s, t, cuda0());
      cpu().causal_softmax_backward(want, dp, 0.7f, ds_want);
      gpu().causal_softmax_backward(want.to(cuda0()), dp.to(cuda0()), 0.7f, ds_got);
      expect_close_scaled(ds_got, ds_want, 2 * tolerance(t),
                          label("causal_softmax_backward", t, s));
    }
  }
}

TEST(CudaKernels, SwiGlu) {
  REQUIRE_CUDA();
  for (DType t : kFloatTypes) {
    for (int64_t n : {1, 9, 4096, 100003}) {
      const Shape s{n};
      Tensor gte = random_cpu(s, t, 50, 2.0f), up = random_cpu(s, t, 51);
      Tensor want = empty(s, t), got = empty(s, t, cuda0());
      cpu().swiglu_forward(gte, up, want);
      gpu().swiglu_forward(gte.to(cuda0()), up.to(cuda0()), got);
      expect_close(got, want, 1e-6f, tolerance(t), label("swiglu", t, s));

      Tensor d = random_cpu(s, t, 52);
      Tensor dg_want = empty(s, t), du_want = empty(s, t);
      Tensor dg_got = empty(s, t, cuda0()), du_got = empty(s, t, cuda0());
      cpu().swiglu_backward(d, gte, up, dg_want, du_want);
      gpu().swiglu_backward(d.to(cuda0()), gte.to(cuda0()), up.to(cuda0()), dg_got, du_got);
      expect_close(dg_got, dg_want, 1e-6f, tolerance(t), label("swiglu dgate", t, s));
      expect_close(du_got, du_want, 1e-6f, tolerance(t), label("swiglu dup", t, s));
    }
  }
}

TEST(CudaKernels, CrossEntropy) {
  REQUIRE_CUDA();
  for (DType t : kFloatTypes) {
    for (auto [N, V] : {std::pair<int64_t, int64_t>{4, 10}, {7, 32000}, {3, 1001}, {1, 1}}) {
      Tensor logits = random_cpu({N, V}, t, 60, 4.0f);
      std::vector<int64_t> tv = testing::random_ids(N, V, 61);
      if (N > 2) tv[1] = -100;  // ignored row
      Tensor targets = from_ints(tv, {N});
      Tensor want = empty({N}), got = empty({N}, DType::F32, cuda0());
      cpu().cross_entropy_forward(logits, targets, want);
      gpu().cross_entropy_forward(logits.to(cuda0()), targets.to(cuda0()), got);
      expect_close(got, want, 1e-4f, 1e-5f, label("cross_entropy", t, {N, V}));

      Tensor d_want = empty({N, V}, t), d_got = empty({N, V}, t, cuda0());
      cpu().cross_entropy_backward(logits, targets, 0.25f, d_want);
      gpu().cross_entropy_backward(logits.to(cuda0()), targets.to(cuda0()), 0.25f, d_got);
      expect_close(d_got, d_want, 1e-6f, tolerance(t), label("cross_entropy_backward", t, {N, V}));
    }
  }
  {
    // Non-finite logits give what the CPU gives: a -inf adds nothing (a whole vector of them
    // before any finite logit, too, and a row of -inf but the target), a nan or a +inf anywhere
    // in the row makes its loss nan. Rows of 4104 logits, so the kernels take vectors and a
    // thread walks several of them.
    const float inf = INFINITY, nan = NAN;
    constexpr int64_t V = 4104;
    std::vector<float> rows(4 * V);
    std::mt19937 gen(79);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    for (float& x : rows) x = normal(gen);
    for (int64_t j : {0, 1, 2, 3, 2049, 4100}) rows[j] = -inf;
    for (int64_t j = 0; j < V; ++j)
      if (j != 3000) rows[V + j] = -inf;
    rows[2 * V + 4000] = nan;
    rows[3 * V + 10] = inf;
    for (DType t : {DType::F32, DType::BF16}) {
      Tensor logits = from_floats(rows, {4, V}, t);
      Tensor targets = from_ints({7, 3000, 0, 1}, {4});
      Tensor want = empty({4}), got = empty({4}, DType::F32, cuda0());
      cpu().cross_entropy_forward(logits, targets, want);
      gpu().cross_entropy_forward(logits.to(cuda0()), targets.to(cuda0()), got);
      const Tensor host = got.to(Device::cpu());
      const float* w = want.data<float>();
      const float* g = host.data<float>();
      EXPECT_TRUE(std::isfinite(w[0]) && w[1] == 0.0f && std::isnan(w[2]) && std::isnan(w[3]));
      for (int64_t r = 0; r < 4; ++r) {
        if (std::isnan(w[r]))
          EXPECT_TRUE(std::isnan(g[r])) << dtype_name(t) << " row " << r << ": got " << g[r];
        else
          EXPECT_NEAR(g[r], w[r], 1e-5f * std::max(1.0f, std::fabs(w[r])))
              << dtype_name(t) << " row " << r;
      }
    }
  }
  Tensor logits = zeros({2, 5}, DType::F32, cuda0());
  Tensor targets = from_ints({1, 5}, {2}, DType::I64, cuda0());
  Tensor losses = empty({2}, DType::F32, cuda0());
  EXPECT_THROW(gpu().cross_entropy_forward(logits, targets, losses), ShapeError);
}

// Operands of mixed dtypes: the kernels compute in fp32 then, so an fp32 output of 16-bit inputs
// is rounded once, as on the CPU, and an fp32 operand is not rounded to 16 bits on the way in.
// Rounding through bf16 would miss the fp32 tolerance below by about 100x.
TEST(CudaKernels, MixedDtypesRoundOnceAsTheCpuBackendDoes) {
  REQUIRE_CUDA();
  constexpr DType lo = DType::BF16, hi = DType::F32;
  const Shape s{6, 40};
  const float rtol = tolerance(hi);
  {
    Tensor x = random_cpu(s, lo, 70), w = random_cpu({40}, hi, 71, 0.5f);
    Tensor want = empty(s, hi), r_want = empty({6});
    Tensor got = empty(s, hi, cuda0()), r_got = empty({6}, hi, cuda0());
    cpu().rmsnorm_forward(x, w, 1e-5f, want, r_want);
    gpu().rmsnorm_forward(x.to(cuda0()), w.to(cuda0()), 1e-5f, got, r_got);
    expect_close(got, want, 1e-6f, rtol, "rmsnorm bf16 x -> f32 y");

    Tensor dy = random_cpu(s, hi, 72);
    Tensor dx_want = empty(s, hi), dw_want = zeros({40});
    Tensor dx_got = empty(s, hi, cuda0()), dw_got = zeros({40}, hi, cuda0());
    cpu().rmsnorm_backward(dy, x, w, r_want, dx_want, dw_want);
    gpu().rmsnorm_backward(dy.to(cuda0()), x.to(cuda0()), w.to(cuda0()), r_want.to(cuda0()), dx_got,
                           dw_got);
    expect_close_scaled(dx_got, dx_want, 2 * rtol, "rmsnorm f32 dy, bf16 x -> f32 dx");
  }
  {
    Tensor x = random_cpu({1, 6, 2, 20}, lo, 73);
    Tensor want = empty({1, 6, 2, 20}, hi), got = empty({1, 6, 2, 20}, hi, cuda0());
    cpu().rope(x, want, RopeParams{10000.0f}, 3, false);
    gpu().rope(x.to(cuda0()), got, RopeParams{10000.0f}, 3, false);
    expect_close(got, want, 2e-5f, rtol, "rope bf16 -> f32");
  }
  {
    Tensor scores = random_cpu({2, 6, 6}, lo, 74, 3.0f);
    Tensor want = empty({2, 6, 6}, hi), got = empty({2, 6, 6}, hi, cuda0());
    cpu().causal_softmax(scores, 0.7f, want);
    gpu().causal_softmax(scores.to(cuda0()), 0.7f, got);
    expect_close(got, want, 1e-6f, rtol, "causal_softmax bf16 -> f32");
  }
  {
    Tensor gate = random_cpu(s, lo, 75, 2.0f), up = random_cpu(s, hi, 76);
    Tensor want = empty(s, hi), got = empty(s, hi, cuda0());
    cpu().swiglu_forward(gate, up, want);
    gpu().swiglu_forward(gate.to(cuda0()), up.to(cuda0()), got);
    expect_close(got, want, 1e-6f, rtol, "swiglu bf16 gate, f32 up -> f32");
  }
  {
    Tensor logits = random_cpu({5, 77}, lo, 77, 4.0f);
    Tensor targets = from_ints(testing::random_ids(5, 77, 78), {5});
    Tensor want = empty({5, 77}, hi), got = empty({5, 77}, hi, cuda0());
    cpu().cross_entropy_backward(logits, targets, 0.25f, want);
    gpu().cross_entropy_backward(logits.to(cuda0()), targets.to(cuda0()), 0.25f, got);
    expect_close(got, want, 1e-6f, rtol, "cross_entropy_backward bf16 logits -> f32 dlogits");
  }
}

TEST(CudaKernels, Nf4DequantizeIsBitwiseTheCpuBackends) {
  REQUIRE_CUDA();
  // Random codes and block scales (any byte is a valid code pair or absmax index), so every
  // codebook entry and every dynamic-map entry is met. n not a multiple of the block (64) or of
  // the absmax group (64 x 256) leaves partial last blocks and groups.
  for (int64_t n : {int64_t{256} * 1000, int64_t{999}, int64_t{70000}, int64_t{1}}) {
    const int64_t blocks = (n + 63) / 64, groups = (blocks + 255) / 256;
    Generator gen(37 + static_cast<uint64_t>(n));
    Tensor codes = rand_uniform({(n + 1) / 2}, gen, 0.0f, 255.99f).to(DType::U8);
    Tensor absmax_q = rand_uniform({blocks}, gen, 0.0f, 255.99f).to(DType::U8);
    Tensor absmax_scale = rand_uniform({groups}, gen, 0.01f, 2.0f);
    const float offset = 0.03125f;
    const Tensor g_absmax_q = absmax_q.to(cuda0()), g_absmax_scale = absmax_scale.to(cuda0());
    // Codes at an even address take the vector kernel, at an odd one the scalar kernel.
    Tensor padded = empty({codes.numel() + 1}, DType::U8, cuda0());
    Tensor odd_codes = padded.slice_rows(1, codes.numel());
    odd_codes.copy_from(codes);
    for (const Tensor& g_codes : {codes.to(cuda0()), odd_codes}) {
      for (DType t : kFloatTypes) {
        Tensor want = empty({n}, t);
        cpu().nf4_dequantize(codes, absmax_q, absmax_scale, offset, want);
        Tensor got = empty({n}, t, cuda0());
        gpu().nf4_dequantize(g_codes, g_absmax_q, g_absmax_scale, offset, got);
        testing::expect_bitwise_equal(
            got, want,
            label(g_codes.data_ptr() == odd_codes.data_ptr() ? "nf4 odd address" : "nf4", t, {n}));
      }
    }
  }
}

TEST(CudaKernels, Reductions) {
  REQUIRE_CUDA();
  for (DType t : kFloatTypes) {
    for (int64_t n : {1, 3, 1000, 1 << 20, 3000017}) {
      Tensor x = random_cpu({n}, t, 70);
      Tensor g = x.to(cuda0());
      const double s_want = cpu().sum(x), q_want = cpu().sum_squares(x);
      const double s_got = gpu().sum(g), q_got = gpu().sum_squares(g);
      EXPECT_NEAR(s_got, s_want, 1e-9 * q_want + 1e-9) << label("sum", t, {n});
      EXPECT_NEAR(q_got, q_want, 1e-9 * q_want) << label("sum_squares", t, {n});
      EXPECT_EQ(gpu().sum(g), s_got) << "sum must be deterministic";
    }
  }
}

TEST(CudaKernels, UnscaleAndCheck) {
  REQUIRE_CUDA();
  for (DType t : kFloatTypes) {
    for (int64_t n : {1, 17, 65537}) {
      Tensor x = random_cpu({n}, t, 80);
      Tensor want = x.clone();
      Tensor g = x.to(cuda0());
      EXPECT_FALSE(gpu().unscale_and_check(g, 0.125f));
      EXPECT_FALSE(cpu().unscale_and_check(want, 0.125f));
      expect_close(g, want, 0.0f, 0.0f, label("unscale", t, {n}));

      std::vector<float> v = x.to_float_vector();
      v[static_cast<size_t>(n / 2)] = std::numeric_limits<float>::infinity();
      Tensor bad = from_floats(v, {n}, t, cuda0());
      EXPECT_TRUE(gpu().unscale_and_check(bad, 0.5f)) << label("inf detection", t, {n});
      v[static_cast<size_t>(n / 2)] = std::numeric_limits<float>::quiet_NaN();
      Tensor nan = from_floats(v, {n}, t, cuda0());
      EXPECT_TRUE(gpu().unscale_and_check(nan, 0.5f)) << label("nan detection", t, {n});
    }
  }
}

TEST(CudaKernels, AdamW) {
  REQUIRE_CUDA();
  for (DType tg : kFloatTypes) {
    for (int64_t n : {1, 7, 100001}) {
      Tensor p = random_cpu({n}, DType::F32, 90), m = zeros({n}), v = zeros({n});
      Tensor gp = p.to(cuda0()), gm = m.to(cuda0()), gv = v.to(cuda0());
      const Backend::AdamWArgs base{1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 1};
      for (int64_t step = 1; step <= 3; ++step) {
        Tensor g = random_cpu({n}, tg, 91 + static_cast<uint64_t>(step));
        Backend::AdamWArgs args = base;
        args.step = step;
        args.grad_scale = step == 3 ? 0.37f : 1.0f;  // a clipped step
        cpu().adamw(p, g, m, v, args);
        gpu().adamw(gp, g.to(cuda0()), gm, gv, args);
      }
      // Same operations in the same order, each rounded separately: the same bits.
      testing::expect_bitwise_equal(gp, p, label("adamw param", tg, {n}));
      testing::expect_bitwise_equal(gm, m, label("adamw m", tg, {n}));
      testing::expect_bitwise_equal(gv, v, label("adamw v", tg, {n}));
    }
  }
}

// The list forms of the gradient-norm and loss-scaling kernels: each tensor's sum of squares is
// the single-tensor result bit for bit; every tensor is unscaled, and an inf in any one of them
// (first, middle or last, in any dtype, in the first or a later launch) is reported. 160 tensors:
// 53 or 54 of each dtype, more than one launch's list of 48.
TEST(CudaKernels, SumSquaresAndUnscaleOverListsEqualThePerTensorCalls) {
  REQUIRE_CUDA();
  std::vector<Tensor> host, dev;
  const int64_t sizes[] = {1, 17, 4096, 65537, 0};
  for (int i = 0; i < 160; ++i) {
    host.push_back(random_cpu({sizes[i % 5]}, kFloatTypes[i % 3], 500 + static_cast<uint64_t>(i)));
    dev.push_back(host.back().to(cuda0()));
  }
  std::vector<const Tensor*> list;
  for (const Tensor& t : dev) list.push_back(&t);
  const std::vector<double> sums = gpu().sum_squares_multi(list);
  ASSERT_EQ(sums.size(), dev.size());
  for (size_t i = 0; i < dev.size(); ++i) {
    EXPECT_EQ(sums[i], gpu().sum_squares(dev[i])) << "tensor " << i;
    EXPECT_NEAR(sums[i], cpu().sum_squares(host[i]), 1e-9 * sums[i]) << "tensor " << i;
  }

  for (size_t bad : {size_t{0}, size_t{7}, size_t{151}, dev.size() - 2}) {
    std::vector<Tensor> want, got;
    std::vector<Tensor*> pointers;
    for (size_t i = 0; i < host.size(); ++i) {
      std::vector<float> v = host[i].to_float_vector();
      if (i == bad) v[v.size() / 2] = std::numeric_limits<float>::infinity();
      want.push_back(from_floats(v, host[i].shape(), host[i].dtype()));
      got.push_back(want.back().to(cuda0()));
    }
    for (Tensor& t : got) pointers.push_back(&t);
    EXPECT_TRUE(gpu().unscale_and_check_multi(pointers, 0.25f)) << "inf in tensor " << bad;
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(cpu().unscale_and_check(want[i], 0.25f), i == bad);
      expect_close(got[i], want[i], 0.0f, 0.0f, "unscaled tensor " + std::to_string(i));
    }
  }
  std::vector<Tensor*> clean;
  for (Tensor& t : dev) clean.push_back(&t);
  EXPECT_FALSE(gpu().unscale_and_check_multi(clean, 0.5f));
  // A tensor the kernels do not take is refused, not left out.
  Tensor ints = from_ints({1, 2, 3}, {3}).to(cuda0());
  clean.push_back(&ints);
  EXPECT_THROW(gpu().unscale_and_check_multi(clean, 0.5f), ShapeError);
}

// The multi-tensor AdamW against the per-tensor CPU AdamW: more tensors than one launch takes,
// every gradient dtype in one list, sizes from 1 element to several blocks' worth, tensors that
// start off the 16-byte alignment the vector path needs, and weight decay on some entries only.
TEST(CudaKernels, AdamWMultiTensorEqualsPerTensorAdamW) {
  REQUIRE_CUDA();
  struct Entry {
    Tensor p, m, v, gp, gm, gv;
    DType grad_type;
    bool decay;
  };
  std::vector<Entry> entries;
  const int64_t sizes[] = {1, 3, 64, 1000, 70001};
  for (int i = 0; i < 100; ++i) {
    const int64_t n = sizes[i % 5];
    Entry e;
    e.grad_type = kFloatTypes[i % 3];
    e.decay = i % 3 != 0;
    e.p = random_cpu({n}, DType::F32, 200 + static_cast<uint64_t>(i));
    e.m = zeros({n});
    e.v = zeros({n});
    if (i % 4 == 1) {  // one element past an aligned start: the scalar path
      e.gp = random_cpu({n + 1}, DType::F32, 1).to(cuda0()).slice_rows(1, n);
      e.gp.copy_from(e.p);
      e.gm = zeros({n + 1}, DType::F32, cuda0()).slice_rows(1, n);
      e.gv = zeros({n + 1}, DType::F32, cuda0()).slice_rows(1, n);
    } else {
      e.gp = e.p.to(cuda0());
      e.gm = e.m.to(cuda0());
      e.gv = e.v.to(cuda0());
    }
    entries.push_back(std::move(e));
  }
  const Backend::AdamWArgs base{1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 1};
  for (int64_t step = 1; step <= 3; ++step) {
    Backend::AdamWArgs args = base;
    args.step = step;
    args.grad_scale = step == 3 ? 0.37f : 1.0f;  // a clipped step
    std::vector<Tensor> grads;                   // the GPU copies, alive until the update has run
    grads.reserve(entries.size());
    std::vector<Backend::AdamWTensor> list;
    for (size_t i = 0; i < entries.size(); ++i) {
      Entry& e = entries[i];
      const Tensor g =
          random_cpu(e.p.shape(), e.grad_type, 300 + 7 * i + static_cast<size_t>(step));
      Backend::AdamWArgs own = args;
      if (!e.decay) own.weight_decay = 0.0f;
      cpu().adamw(e.p, g, e.m, e.v, own);
      grads.push_back(g.to(cuda0()));
      list.push_back({&e.gp, &grads.back(), &e.gm, &e.gv, e.decay});
    }
    gpu().adamw_multi(list, args);
  }
  for (size_t i = 0; i < entries.size(); ++i) {
    const Entry& e = entries[i];
    const std::string what = "adamw_multi entry " + std::to_string(i) + " " +
                             label("", e.grad_type, e.p.shape()) +
                             (e.decay ? " decay" : " no decay");
    testing::expect_bitwise_equal(e.gp, e.p, what + " param");
    testing::expect_bitwise_equal(e.gm, e.m, what + " m");
    testing::expect_bitwise_equal(e.gv, e.v, what + " v");
  }
}

}  // namespace
}  // namespace shardtrain
