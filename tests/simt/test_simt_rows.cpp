// The row kernels (kernels/rmsnorm.cu, rope.cu, softmax.cu, cross_entropy.cu) on the simt
// emulator against the CPU backend, with the shapes and tolerances of tests/cuda/kernels.cpp:
// RMSNorm forward and backward (block reductions, rows wider than a block, the column-sum weight
// gradient), RoPE plain and Llama-3 scaled, forward and inverse, at near and far positions and
// past the in-parameter frequency table, causal softmax and its backward, and cross-entropy with
// ignored rows. Vector and scalar paths, outputs over their inputs, and bit-identical results
// under every schedule.
#include <cmath>
#include <limits>

#include "simt_kernel_checks.h"

namespace shardtrain {
namespace {

using testing::cpu;
using testing::expect_close;
using testing::expect_close_scaled;
using testing::kAlignments;
using testing::kFloatTypes;
using testing::Operand;
using testing::Place;
using testing::random_cpu;
using testing::tolerance;
using testing::under_every_schedule;
using Results = std::vector<Tensor>;

std::string label(const std::string& op, std::initializer_list<DType> types, const Shape& shape,
                  Place place) {
  std::string s = op;
  for (DType t : types) s.append(" ").append(dtype_name(t));
  return s.append(" ").append(shape_str(shape)).append(" ").append(testing::place_name(place));
}

// ---- RMSNorm --------------------------------------------------------------------------------

TEST(SimtRows, RmsNormForwardAndBackwardMatchTheCpuBackend) {
  for (DType t : kFloatTypes) {
    for (DType tw : {DType::F32, t}) {
      // Rows of 4096 are several passes of a 256-thread block; 37 is no multiple of a vector.
      for (Shape s : {Shape{4, 64}, Shape{3, 5, 37}, Shape{33, 4096}, Shape{2, 1}}) {
        const int64_t H = s.back(), N = numel(s) / H;
        const Tensor x = random_cpu(s, t, 20), w = random_cpu({H}, tw, 21, 0.5f);
        const Tensor dy = random_cpu(s, t, 22);
        const Tensor dw_start = random_cpu({H}, DType::F32, 23);  // accumulated into
        Tensor y_want = empty(s, t), r_want = empty({N});
        cpu().rmsnorm_forward(x, w, 1e-5f, y_want, r_want);
        Tensor dx_want = empty(s, t), dw_want = dw_start.clone();
        cpu().rmsnorm_backward(dy, x, w, r_want, dx_want, dw_want);
        for (Place place : kAlignments) {
          under_every_schedule(
              label("rmsnorm", {t, tw}, s, place),
              [&](const std::string& run) {
                Operand dx_in(x, place), dw_in(w, place), y(s, t, place), rstd({N}, DType::F32);
                Operand ddy(dy, place), r(r_want), dx(s, t, place), dw(dw_start);
                testing::GuardedScratch scratch;
                kernels::rmsnorm_forward(dx_in.data(), t, dw_in.data(), tw, 1e-5f, y.data(),
                                         rstd.f32(), N, H, nullptr);
                // The backward takes the CPU's rstd, so that both sides see the same inputs.
                kernels::rmsnorm_backward(ddy.data(), dx_in.data(), t, dw_in.data(), tw, r.f32(),
                                          dx.data(), dw.f32(), N, H, scratch, nullptr);
                y.expect_margins_untouched(run + " y");
                rstd.expect_margins_untouched(run + " rstd");
                dx.expect_margins_untouched(run + " dx");
                dw.expect_margins_untouched(run + " dw");
                return Results{y.to_tensor(), rstd.to_tensor(), dx.to_tensor(), dw.to_tensor()};
              },
              [&](const Results& got, const std::string& run) {
                expect_close(got[1], r_want, 0.0f, 1e-5f, run + " rstd");
                expect_close(got[0], y_want, 1e-5f, tolerance(t), run + " y");
                // Unit floor: with H = 1, dx = rstd w dy eps rstd^2 is what is left of two
                // equal terms.
                expect_close_scaled(got[2], dx_want, 2 * tolerance(t), run + " dx", 1.0f);
                expect_close_scaled(got[3], dw_want, 1e-5f, run + " dw");
              });
        }
      }
    }
  }
}

// dx written over dy: the weight gradient is computed first, and each thread rewrites only the
// elements it read.
TEST(SimtRows, RmsNormBackwardInPlace) {
  const Shape s{8, 48};
  const Tensor x = random_cpu(s, DType::F32, 24), w = random_cpu({48}, DType::F32, 25);
  Tensor r = empty({8}), y = empty(s);
  cpu().rmsnorm_forward(x, w, 1e-6f, y, r);
  const Tensor dy = random_cpu(s, DType::F32, 26);
  Tensor dx_want = empty(s), dw_want = zeros({48});
  cpu().rmsnorm_backward(dy, x, w, r, dx_want, dw_want);
  under_every_schedule(
      "rmsnorm dx over dy",
      [&](const std::string&) {
        Operand g(dy), dx(x), dw_in(w), dr(r), dw(zeros({48}));
        testing::GuardedScratch scratch;
        kernels::rmsnorm_backward(g.data(), dx.data(), DType::F32, dw_in.data(), DType::F32,
                                  dr.f32(), g.data(), dw.f32(), 8, 48, scratch, nullptr);
        return Results{g.to_tensor(), dw.to_tensor()};
      },
      [&](const Results& got, const std::string& run) {
        expect_close_scaled(got[0], dx_want, 1e-5f, run + " dx");
        expect_close_scaled(got[1], dw_want, 1e-5f, run + " dw");
      });
}

// ---- RoPE -----------------------------------------------------------------------------------

struct RopeCase {
  Shape shape;
  DType type;
  RopeParams params;
  int64_t offset;
  bool inverse;
  float atol, rtol;
};

void check_rope(const RopeCase& c, Place place) {
  const Shape& s = c.shape;
  const Tensor x = random_cpu(s, c.type, 30);
  Tensor want = empty(s, c.type);
  cpu().rope(x, want, c.params, c.offset, c.inverse);
  const std::string what =
      label(std::string(c.params.llama3 ? "llama3 rope" : "rope") + (c.inverse ? " inverse" : "") +
                " at " + std::to_string(c.offset),
            {c.type}, s, place);
  under_every_schedule(
      what,
      [&](const std::string& run) {
        Operand dx(x, place), out(s, c.type, place);
        testing::GuardedScratch scratch;
        kernels::rope(dx.data(), out.data(), c.type, s[0], s[1], s[2], s[3], c.params, c.offset,
                      c.inverse, scratch, nullptr);
        out.expect_margins_untouched(run);
        return Results{out.to_tensor()};
      },
      [&](const Results& got, const std::string& run) {
        expect_close(got[0], want, c.atol, c.rtol, run);
      });
}

// Head dims within the kernel-parameter frequency table and past it (1030: unscaled frequencies
// computed on the device; 2050 with Llama-3 scaling: the host's copied through the scratch);
// 300 positions x 2 heads x 64 pairs are more pairs than the grid has threads.
TEST(SimtRows, RopeMatchesTheCpuBackend) {
  const Llama3RopeScaling llama31{8.0, 1.0, 4.0, 8192};
  for (DType t : kFloatTypes) {
    for (Shape s : {Shape{2, 17, 3, 64}, Shape{1, 300, 2, 128}, Shape{1, 5, 1, 6}}) {
      for (bool inverse : {false, true}) {
        check_rope({s, t, RopeParams{10000.0f}, 7, inverse, 2e-5f, tolerance(t)}, Place::aligned);
        check_rope({s, t, RopeParams{500000.0f, llama31}, 7, inverse, 2e-5f, tolerance(t)},
                   Place::aligned);
      }
    }
    check_rope({{1, 3, 1, 1030}, t, RopeParams{500000.0f, llama31}, 7, false, 2e-5f, tolerance(t)},
               Place::offset);
  }
  // Far positions: equal angles need equal inverse frequencies.
  check_rope({{1, 4, 2, 128}, DType::F32, RopeParams{500000.0f}, 131000, false, 2e-5f, 2e-5f},
             Place::offset);
  check_rope({{1, 3, 1, 1030}, DType::F32, RopeParams{500000.0f}, 7, false, 2e-5f, 2e-5f},
             Place::aligned);
  check_rope(
      {{1, 4, 2, 128}, DType::F32, RopeParams{500000.0f, llama31}, 131000, true, 2e-5f, 2e-5f},
      Place::aligned);
  check_rope(
      {{1, 3, 1, 2050}, DType::F32, RopeParams{500000.0f, llama31}, 60000, false, 2e-5f, 2e-5f},
      Place::aligned);
}

// In place, forward then inverse is the identity, within the table and past it.
TEST(SimtRows, RopeInPlaceRoundTrip) {
  const Llama3RopeScaling llama31{8.0, 1.0, 4.0, 8192};
  for (Shape s : {Shape{2, 9, 2, 32}, Shape{1, 5, 2, 1030}}) {
    for (const RopeParams& params : {RopeParams{500000.0f}, RopeParams{500000.0f, llama31}}) {
      const Tensor x = random_cpu(s, DType::F32, 35);
      Tensor rotated = empty(s);
      cpu().rope(x, rotated, params, 100, false);
      under_every_schedule(
          label(params.llama3 ? "llama3 rope round trip" : "rope round trip", {DType::F32}, s,
                Place::aligned),
          [&](const std::string&) {
            Operand g(x);
            testing::GuardedScratch scratch;
            kernels::rope(g.data(), g.data(), DType::F32, s[0], s[1], s[2], s[3], params, 100,
                          false, scratch, nullptr);
            Tensor forward = g.to_tensor();
            kernels::rope(g.data(), g.data(), DType::F32, s[0], s[1], s[2], s[3], params, 100, true,
                          scratch, nullptr);
            return Results{forward, g.to_tensor()};
          },
          [&](const Results& got, const std::string& run) {
            expect_close(got[0], rotated, 2e-5f, 2e-5f, run + " forward");
            expect_close(got[1], x, 1e-5f, 1e-5f, run + " round trip");
          });
    }
  }
}

// ---- causal softmax -------------------------------------------------------------------------

// [N, Sq, Sk] with Sk >= Sq (keys include a prefix), ragged lengths, rows longer than a warp's
// 32 lanes many times over, more rows than one block's 8 warps, and Sk < Sq (rows with no
// visible key: all zero).
TEST(SimtRows, CausalSoftmaxAndItsBackwardMatchTheCpuBackend) {
  for (DType t : kFloatTypes) {
    for (Shape s :
         {Shape{2, 16, 16}, Shape{3, 5, 9}, Shape{1, 33, 33}, Shape{2, 7, 1030}, Shape{1, 4, 2}}) {
      const int64_t Sk = s[2], Sq = s[1], rows = numel(s) / Sk;
      const Tensor x = random_cpu(s, t, 40, 3.0f), dp = random_cpu(s, t, 41);
      Tensor want = empty(s, t), ds_want = empty(s, t);
      cpu().causal_softmax(x, 0.7f, want);
      cpu().causal_softmax_backward(want, dp, 0.7f, ds_want);
      for (Place place : kAlignments) {
        under_every_schedule(
            label("causal_softmax", {t}, s, place),
            [&](const std::string& run) {
              Operand scores(x, place), probs(s, t, place), p_in(want, place), ddp(dp, place);
              Operand ds(s, t, place);
              kernels::causal_softmax(scores.data(), probs.data(), t, rows, Sq, Sk, 0.7f, nullptr);
              // From the CPU's probabilities, so that both sides see the same inputs.
              kernels::causal_softmax_backward(p_in.data(), ddp.data(), ds.data(), t, rows, Sk,
                                               0.7f, nullptr);
              probs.expect_margins_untouched(run + " probs");
              ds.expect_margins_untouched(run + " dscores");
              return Results{probs.to_tensor(), ds.to_tensor()};
            },
            [&](const Results& got, const std::string& run) {
              expect_close(got[0], want, 1e-6f, tolerance(t), run + " probs");
              expect_close_scaled(got[1], ds_want, 2 * tolerance(t), run + " dscores");
            });
      }
    }
  }
}

TEST(SimtRows, CausalSoftmaxInPlace) {
  const Shape s{2, 9, 40};
  const Tensor x = random_cpu(s, DType::F16, 42, 3.0f), dp = random_cpu(s, DType::F16, 43);
  Tensor want = empty(s, DType::F16), ds_want = empty(s, DType::F16);
  cpu().causal_softmax(x, 0.5f, want);
  cpu().causal_softmax_backward(want, dp, 0.5f, ds_want);
  under_every_schedule(
      "causal_softmax over its input",
      [&](const std::string&) {
        Operand buf(x), p(want), d(dp);
        kernels::causal_softmax(buf.data(), buf.data(), DType::F16, 18, 9, 40, 0.5f, nullptr);
        kernels::causal_softmax_backward(p.data(), d.data(), d.data(), DType::F16, 18, 40, 0.5f,
                                         nullptr);
        return Results{buf.to_tensor(), d.to_tensor()};
      },
      [&](const Results& got, const std::string& run) {
        expect_close(got[0], want, 1e-6f, tolerance(DType::F16), run + " probs");
        expect_close_scaled(got[1], ds_want, 2 * tolerance(DType::F16), run + " dscores");
      });
}

// ---- cross-entropy --------------------------------------------------------------------------

void check_cross_entropy(const Tensor& logits, const std::vector<int64_t>& target_ids,
                         Place place) {
  const DType t = logits.dtype();
  const int64_t N = logits.size(0), V = logits.size(1);
  const Tensor targets = from_ints(target_ids, {N});
  Tensor want = empty({N}), d_want = empty({N, V}, t);
  cpu().cross_entropy_forward(logits, targets, want);
  cpu().cross_entropy_backward(logits, targets, 0.25f, d_want);
  under_every_schedule(
      label("cross_entropy", {t}, {N, V}, place),
      [&](const std::string& run) {
        Operand dl(logits, place), dt(targets), losses({N}, DType::F32), d({N, V}, t, place);
        kernels::cross_entropy_forward(dl.data(), t, dt.as<int64_t>(), losses.f32(), N, V, nullptr);
        kernels::cross_entropy_backward(dl.data(), t, dt.as<int64_t>(), 0.25f, d.data(), N, V,
                                        nullptr);
        losses.expect_margins_untouched(run + " losses");
        d.expect_margins_untouched(run + " dlogits");
        return Results{losses.to_tensor(), d.to_tensor()};
      },
      [&](const Results& got, const std::string& run) {
        expect_close(got[0], want, 1e-4f, 1e-5f, run + " losses");
        expect_close(got[1], d_want, 1e-6f, tolerance(t), run + " dlogits");
      });
}

// Vocabularies smaller than the 512-thread block, many times larger (32000), and ragged (1001,
// the scalar path); a row whose target is the ignore index (-100) has loss 0 and gradient 0.
TEST(SimtRows, CrossEntropyMatchesTheCpuBackend) {
  for (DType t : kFloatTypes) {
    for (auto [N, V] :
         {std::pair<int64_t, int64_t>{4, 10}, {7, 32000}, {3, 1001}, {5, 64}, {1, 1}}) {
      const Tensor logits = random_cpu({N, V}, t, 60, 4.0f);
      std::vector<int64_t> targets = testing::random_ids(N, V, 61);
      if (N > 2) targets[1] = -100;
      for (Place place : kAlignments) check_cross_entropy(logits, targets, place);
    }
  }
}

// Masked logits (-inf) add nothing to a row's sum, a nan spreads to its row only, and a row of
// -inf but its target is a certain prediction.
TEST(SimtRows, CrossEntropyWithInfiniteAndNanLogits) {
  const float inf = std::numeric_limits<float>::infinity();
  const int64_t N = 4, V = 1000;
  std::vector<float> v = random_cpu({N, V}, DType::F32, 62, 4.0f).to_float_vector();
  for (int64_t j = 0; j < V; j += 3) v[static_cast<size_t>(j)] = -inf;        // row 0: every third
  v[static_cast<size_t>(V + 500)] = std::numeric_limits<float>::quiet_NaN();  // row 1
  for (int64_t j = 0; j < V; ++j)
    if (j != 7) v[static_cast<size_t>(3 * V + j)] = -inf;  // row 3: all but the target
  for (DType t : kFloatTypes) {
    const Tensor logits = from_floats(v, {N, V}, t);
    for (Place place : kAlignments) check_cross_entropy(logits, {1, 2, 3, 7}, place);
  }
}

// dlogits written over the logits.
TEST(SimtRows, CrossEntropyBackwardInPlace) {
  const int64_t N = 3, V = 4096;
  const Tensor logits = random_cpu({N, V}, DType::BF16, 63, 4.0f);
  const Tensor targets = from_ints({5, -100, 4095}, {N});
  Tensor want = empty({N, V}, DType::BF16);
  cpu().cross_entropy_backward(logits, targets, 0.5f, want);
  under_every_schedule(
      "cross_entropy_backward over the logits",
      [&](const std::string&) {
        Operand l(logits), dt(targets);
        kernels::cross_entropy_backward(l.data(), DType::BF16, dt.as<int64_t>(), 0.5f, l.data(), N,
                                        V, nullptr);
        return Results{l.to_tensor()};
      },
      [&](const Results& got, const std::string& run) {
        expect_close(got[0], want, 1e-6f, tolerance(DType::BF16), run);
      });
}

}  // namespace
}  // namespace shardtrain
