// The elementwise kernels (kernels/elementwise.cu, swiglu.cu, layout.cu, nf4.cu) on the simt
// emulator against the CPU backend: fill, cast between every pair of dtypes, add, mul, scale,
// the last-dimension broadcast multiply and its weight gradient, SwiGLU, permute_0213 and NF4
// dequantization. Operands start aligned (the vector paths) and one element off (the scalar
// paths), sizes leave vector remainders, and one case per family is large enough that the
// grid-stride loops go round more than once (the emulated device has 2 SMs, so grids stop at 32
// blocks of 256 threads). Every run is repeated under every schedule with bit-identical results,
// and nothing may be written outside the output.
#include <cmath>

// simt.h (through simt_kernel_checks.h) must come before the CUDA headers.
#include "simt_kernel_checks.h"

#include "nf4_kernels.h"
#include "shardtrain/backend/nf4_codebook.h"

namespace shardtrain {
namespace {

using testing::cpu;
using testing::expect_bitwise_equal;
using testing::expect_close;
using testing::kAlignments;
using testing::kFloatTypes;
using testing::Operand;
using testing::Place;
using testing::random_cpu;
using testing::tolerance;
using testing::under_every_schedule;
using Results = std::vector<Tensor>;

constexpr DType kAllTypes[] = {DType::F32, DType::BF16, DType::F16,
                               DType::I32, DType::I64,  DType::U8};

// More elements than one pass of the largest grid covers four at a time (32 x 256 x 4).
constexpr int64_t kLoops = 70001;

std::string label(const std::string& op, std::initializer_list<DType> types, const Shape& shape,
                  Place place) {
  std::string s = op;
  for (DType t : types) s.append(" ").append(dtype_name(t));
  return s.append(" ").append(shape_str(shape)).append(" ").append(testing::place_name(place));
}

Tensor random_bytes(int64_t n, uint64_t seed) {
  Generator gen(seed);
  std::vector<float> u(static_cast<size_t>(n));
  gen.uniform(u.data(), n);
  std::vector<int64_t> bytes(u.size());
  for (size_t i = 0; i < u.size(); ++i) bytes[i] = std::min<int64_t>(255, int64_t(u[i] * 256.0f));
  return from_ints(bytes, {n}, DType::U8);
}

TEST(SimtElementwise, FillWritesTheCpuBackendsBits) {
  for (DType t : kAllTypes) {
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{4099}, kLoops}) {
      // The 16-byte path needs an aligned start; a start at the guard page with a length that is
      // not a multiple of 16 bytes takes the word path and shows any write past the end.
      for (Place place : {Place::aligned, Place::offset, Place::end_at_guard}) {
        for (float value : {3.0f, -0.3f}) {
          if (!is_floating(t) && value < 0.0f) continue;  // not representable
          Tensor want = empty({n}, t);
          cpu().fill(want, value);
          under_every_schedule(
              label("fill " + std::to_string(value), {t}, {n}, place),
              [&](const std::string& run) {
                Operand out({n}, t, place);
                kernels::fill(out.data(), t, n, value, nullptr);
                out.expect_margins_untouched(run);
                return Results{out.to_tensor()};
              },
              [&](const Results& got, const std::string& run) {
                expect_bitwise_equal(got[0], want, run);
              });
        }
      }
    }
  }
}

// Every pair of dtypes, integers included, with the semantics of convert_elements; equal dtypes
// are a plain copy.
TEST(SimtElementwise, CastBetweenEveryPairOfDtypesMatchesTheCpuBackend) {
  for (DType from : kAllTypes) {
    for (DType to : kAllTypes) {
      for (Place place : kAlignments) {
        const Shape shape{3, 37};
        Generator gen(11);
        const Tensor src = rand_uniform(shape, gen, 0.0f, 100.0f, DType::F32).to(from);
        Tensor want = empty(shape, to);
        cpu().cast(src, want);
        under_every_schedule(
            label("cast", {from, to}, shape, place),
            [&](const std::string& run) {
              Operand s(src, place), d(shape, to, place);
              kernels::cast(s.data(), from, d.data(), to, src.numel(), nullptr);
              d.expect_margins_untouched(run);
              return Results{d.to_tensor()};
            },
            [&](const Results& got, const std::string& run) {
              expect_bitwise_equal(got[0], want, run);
            });
      }
    }
  }
  // Long enough that the vector and the scalar grid-stride loops go round.
  for (auto [from, to] : {std::pair{DType::F32, DType::BF16}, std::pair{DType::F16, DType::F32},
                          std::pair{DType::I32, DType::F16}}) {
    for (Place place : kAlignments) {
      const Tensor src = random_cpu({kLoops}, DType::F32, 12, 50.0f).to(from);
      Tensor want = empty({kLoops}, to);
      cpu().cast(src, want);
      under_every_schedule(
          label("cast", {from, to}, {kLoops}, place),
          [&](const std::string& run) {
            Operand s(src, place), d({kLoops}, to, place);
            kernels::cast(s.data(), from, d.data(), to, kLoops, nullptr);
            d.expect_margins_untouched(run);
            return Results{d.to_tensor()};
          },
          [&](const Results& got, const std::string& run) {
            expect_bitwise_equal(got[0], want, run);
          });
    }
  }
}

// add rounds both products before the sum (no fused multiply-add) and mul and scale round once,
// as the CPU backend does: the same bits.
void check_add_mul(DType ta, DType tb, DType to, int64_t n, Place place) {
  const Shape s{n};
  const Tensor a = random_cpu(s, ta, 1), b = random_cpu(s, tb, 2);
  Tensor add_want = empty(s, to), mul_want = empty(s, to);
  cpu().add(a, b, add_want, 0.5f, -2.0f);
  cpu().mul(a, b, mul_want);
  under_every_schedule(
      label("add, mul", {ta, tb, to}, s, place),
      [&](const std::string& run) {
        Operand da(a, place), db(b, place), sum(s, to, place), product(s, to, place);
        kernels::add(da.data(), ta, db.data(), tb, sum.data(), to, n, 0.5f, -2.0f, nullptr);
        kernels::mul(da.data(), ta, db.data(), tb, product.data(), to, n, nullptr);
        sum.expect_margins_untouched(run + " add");
        product.expect_margins_untouched(run + " mul");
        return Results{sum.to_tensor(), product.to_tensor()};
      },
      [&](const Results& got, const std::string& run) {
        expect_bitwise_equal(got[0], add_want, run + " add");
        expect_bitwise_equal(got[1], mul_want, run + " mul");
      });
}

TEST(SimtElementwise, AddAndMulMatchTheCpuBackendBitForBit) {
  for (DType ta : kFloatTypes)
    for (DType tb : kFloatTypes)
      for (DType to : kFloatTypes)
        for (int64_t n : {1, 5, 1027})
          for (Place place : kAlignments) check_add_mul(ta, tb, to, n, place);
  for (Place place : kAlignments) {
    check_add_mul(DType::F32, DType::F32, DType::F32, kLoops, place);
    check_add_mul(DType::BF16, DType::F16, DType::F32, kLoops, place);
  }
}

// out aliasing an input, at an offset start (the scalar path) and an aligned one.
TEST(SimtElementwise, AddInPlace) {
  for (Place place : kAlignments) {
    const Tensor a = random_cpu({1001}, DType::BF16, 4), b = random_cpu({1001}, DType::F32, 5);
    Tensor want = a.clone();
    cpu().add(want, b, want, 1.0f, 3.0f);
    under_every_schedule(
        label("in-place add", {DType::BF16, DType::F32}, {1001}, place),
        [&](const std::string& run) {
          Operand da(a, place), db(b, place);
          kernels::add(da.data(), DType::BF16, db.data(), DType::F32, da.data(), DType::BF16, 1001,
                       1.0f, 3.0f, nullptr);
          da.expect_margins_untouched(run);
          return Results{da.to_tensor()};
        },
        [&](const Results& got, const std::string& run) {
          expect_bitwise_equal(got[0], want, run);
        });
  }
}

TEST(SimtElementwise, ScaleMatchesTheCpuBackendBitForBit) {
  for (DType ta : kFloatTypes) {
    for (DType to : kFloatTypes) {
      for (int64_t n : {int64_t{333}, kLoops}) {
        if (n == kLoops && ta != to) continue;  // the long case once per dtype
        for (Place place : kAlignments) {
          const Tensor a = random_cpu({n}, ta, 3);
          Tensor want = empty({n}, to);
          cpu().scale(a, want, -1.5f);
          under_every_schedule(
              label("scale", {ta, to}, {n}, place),
              [&](const std::string& run) {
                Operand da(a, place), out({n}, to, place);
                kernels::scale(da.data(), ta, out.data(), to, n, -1.5f, nullptr);
                out.expect_margins_untouched(run);
                return Results{out.to_tensor()};
              },
              [&](const Results& got, const std::string& run) {
                expect_bitwise_equal(got[0], want, run);
              });
        }
      }
    }
  }
}

// mul_lastdim is one product per element (the CPU's bits); its weight gradient is a two-stage
// column sum in fp32, against the CPU's fp64 sums, so within the tolerance of tests/cuda.
TEST(SimtElementwise, MulLastdimAndItsWeightGradientMatchTheCpuBackend) {
  for (DType t : kFloatTypes) {
    for (DType tw : {DType::F32, t}) {
      // Widths that are and are not multiples of the vector, one row, and enough rows that the
      // vector loop (40 x 1024 / 4 vectors) and the scalar loop (33 x 1030) go round; the column
      // sums split 1030 rows into five partial ranges.
      for (Shape s : {Shape{4, 64}, Shape{3, 7, 33}, Shape{40, 1024}, Shape{33, 1030},
                      Shape{1030, 20}, Shape{1, 1}}) {
        const int64_t width = s.back(), n = numel(s);
        const Tensor x = random_cpu(s, t, 6), w = random_cpu({width}, tw, 7);
        const Tensor dy = random_cpu(s, t, 8);
        const Tensor gw_start = random_cpu({width}, DType::F32, 9);  // accumulated into
        Tensor want = empty(s, t), gw_want = gw_start.clone();
        cpu().mul_lastdim(x, w, want);
        cpu().mul_lastdim_backward_weight(dy, x, gw_want);
        for (Place place : kAlignments) {
          under_every_schedule(
              label("mul_lastdim", {t, tw}, s, place),
              [&](const std::string& run) {
                Operand dx(x, place), dw(w, place), out(s, t, place), ddy(dy, place);
                Operand gw(gw_start, place);
                testing::GuardedScratch scratch;
                kernels::mul_lastdim(dx.data(), t, dw.data(), tw, out.data(), t, n, width, nullptr);
                kernels::mul_lastdim_backward_weight(ddy.data(), t, dx.data(), t, gw.f32(),
                                                     n / width, width, scratch, nullptr);
                out.expect_margins_untouched(run + " out");
                gw.expect_margins_untouched(run + " grad_w");
                return Results{out.to_tensor(), gw.to_tensor()};
              },
              [&](const Results& got, const std::string& run) {
                expect_bitwise_equal(got[0], want, run);
                testing::expect_close_scaled(got[1], gw_want, 1e-5f, run + " backward weight");
              });
        }
      }
    }
  }
}

// expf is the host's on both sides here, but the bounds are those of tests/cuda, where the
// device's expf differs from the host's.
TEST(SimtElementwise, SwiGluForwardAndBackwardMatchTheCpuBackend) {
  for (DType t : kFloatTypes) {
    for (int64_t n : {int64_t{1}, int64_t{9}, int64_t{4096}, int64_t{100003}}) {
      for (Place place : kAlignments) {
        const Shape s{n};
        const Tensor gate = random_cpu(s, t, 50, 2.0f), up = random_cpu(s, t, 51);
        const Tensor d = random_cpu(s, t, 52);
        Tensor want = empty(s, t), dg_want = empty(s, t), du_want = empty(s, t);
        cpu().swiglu_forward(gate, up, want);
        cpu().swiglu_backward(d, gate, up, dg_want, du_want);
        under_every_schedule(
            label("swiglu", {t}, s, place),
            [&](const std::string& run) {
              Operand g(gate, place), u(up, place), dd(d, place), out(s, t, place);
              Operand dg(s, t, place), du(s, t, place);
              kernels::swiglu_forward(g.data(), u.data(), out.data(), t, n, nullptr);
              kernels::swiglu_backward(dd.data(), g.data(), u.data(), dg.data(), du.data(), t, n,
                                       nullptr);
              out.expect_margins_untouched(run + " out");
              dg.expect_margins_untouched(run + " dgate");
              du.expect_margins_untouched(run + " dup");
              return Results{out.to_tensor(), dg.to_tensor(), du.to_tensor()};
            },
            [&](const Results& got, const std::string& run) {
              expect_close(got[0], want, 1e-6f, tolerance(t), run + " out");
              expect_close(got[1], dg_want, 1e-6f, tolerance(t), run + " dgate");
              expect_close(got[2], du_want, 1e-6f, tolerance(t), run + " dup");
            });
      }
    }
  }
}

// Outputs written over their inputs: out over gate, then dgate over dout and dup over up.
TEST(SimtElementwise, SwiGluInPlace) {
  const Shape s{1003};
  for (Place place : kAlignments) {
    const Tensor gate = random_cpu(s, DType::BF16, 53, 2.0f), up = random_cpu(s, DType::BF16, 54);
    const Tensor d = random_cpu(s, DType::BF16, 55);
    Tensor want = empty(s, DType::BF16), dg_want = empty(s, DType::BF16),
           du_want = empty(s, DType::BF16);
    cpu().swiglu_forward(gate, up, want);
    cpu().swiglu_backward(d, gate, up, dg_want, du_want);
    under_every_schedule(
        label("in-place swiglu", {DType::BF16}, s, place),
        [&](const std::string&) {
          Operand g(gate, place), u(up, place), dd(d, place), g2(gate, place);
          kernels::swiglu_forward(g.data(), u.data(), g.data(), DType::BF16, 1003, nullptr);
          kernels::swiglu_backward(dd.data(), g2.data(), u.data(), dd.data(), u.data(), DType::BF16,
                                   1003, nullptr);
          return Results{g.to_tensor(), dd.to_tensor(), u.to_tensor()};
        },
        [&](const Results& got, const std::string& run) {
          expect_close(got[0], want, 1e-6f, tolerance(DType::BF16), run + " out");
          expect_close(got[1], dg_want, 1e-6f, tolerance(DType::BF16), run + " dgate");
          expect_close(got[2], du_want, 1e-6f, tolerance(DType::BF16), run + " dup");
        });
  }
}

// Rows copied in 16, 8, 4, 2 or 1-byte words, whichever the row length and both pointers allow.
TEST(SimtElementwise, Permute0213MovesTheCpuBackendsBits) {
  for (DType t : {DType::F32, DType::BF16, DType::I64, DType::U8}) {
    // The last shape has more 16-byte words (768 rows of 16) than the grid has threads.
    for (Shape s :
         {Shape{2, 3, 4, 64}, Shape{1, 5, 3, 7}, Shape{3, 17, 2, 1}, Shape{4, 64, 3, 64}}) {
      for (Place place : kAlignments) {
        Generator gen(12);
        const Tensor x = rand_uniform(s, gen, 0.0f, 100.0f, DType::F32).to(t);
        const Shape o{s[0], s[2], s[1], s[3]};
        Tensor want = empty(o, t);
        cpu().permute_0213(x, want);
        under_every_schedule(
            label("permute_0213", {t}, s, place),
            [&](const std::string& run) {
              Operand dx(x, place), out(o, t, place);
              kernels::permute_0213(dx.data(), out.data(), dtype_size(t), s[0], s[1], s[2], s[3],
                                    nullptr);
              out.expect_margins_untouched(run);
              return Results{out.to_tensor()};
            },
            [&](const Results& got, const std::string& run) {
              expect_bitwise_equal(got[0], want, run);
            });
      }
    }
  }
}

// Random codes and block statistics; sizes inside one 64-weight block, across blocks and groups
// of 256 blocks, not multiples of the 16 weights of a thread, and more 16-weight groups than the
// grid has threads (140003 / 16 > 8192).
TEST(SimtElementwise, Nf4DequantizeMatchesTheCpuBackendBitForBit) {
  for (DType t : kFloatTypes) {
    for (int64_t n : {1, 15, 64, 1000, 16 * 1024 + 16, 140003}) {
      const Tensor codes = random_bytes(nf4::num_code_bytes(n), 100);
      const Tensor absmax_q = random_bytes(nf4::num_blocks(n), 101);
      Generator gen(102);
      const Tensor scale = rand_uniform({nf4::num_absmax_groups(n)}, gen, 0.5f, 2.0f, DType::F32);
      const float offset = 0.0123f;
      Tensor want = empty({n}, t);
      cpu().nf4_dequantize(codes, absmax_q, scale, offset, want);
      for (Place place : kAlignments) {
        under_every_schedule(
            label("nf4_dequantize", {t}, {n}, place),
            [&](const std::string& run) {
              Operand c(codes, place), q(absmax_q, place), sc(scale, place), out({n}, t, place);
              kernels::nf4_dequantize(c.as<uint8_t>(), q.as<uint8_t>(), sc.f32(), offset,
                                      out.data(), t, n, nullptr);
              out.expect_margins_untouched(run);
              return Results{out.to_tensor()};
            },
            [&](const Results& got, const std::string& run) {
              expect_bitwise_equal(got[0], want, run);
            });
      }
    }
  }
}

}  // namespace
}  // namespace shardtrain
