// The reduction and optimizer kernels (kernels/reduce.cu, adamw.cu) on the simt emulator against
// the CPU backend: fp64 sums and sums of squares (one block, many blocks, the 1024-block cap with
// grid-stride loops, vector and scalar loads), the list form of the sum of squares, unscaling
// with inf/nan detection (also in the scalar tail and in any tensor of a list), and AdamW on a
// single tensor and on lists that take several launches. Bit-identical results under every
// schedule (so the sums are also equal from run to run).
#include <cmath>
#include <limits>

#include "simt_kernel_checks.h"

namespace shardtrain {
namespace {

using testing::cpu;
using testing::expect_bitwise_equal;
using testing::kAlignments;
using testing::kFloatTypes;
using testing::Operand;
using testing::Place;
using testing::random_cpu;
using testing::under_every_schedule;
using Results = std::vector<Tensor>;

std::string label(const std::string& op, DType t, int64_t n, Place place) {
  return std::string(op)
      .append(" ")
      .append(dtype_name(t))
      .append(" [")
      .append(std::to_string(n))
      .append("] ")
      .append(testing::place_name(place));
}

// A double's bits as a tensor, for the schedule comparison.
Tensor bits_of(double d) {
  return from_buffer(&d, {static_cast<int64_t>(sizeof d)}, DType::U8);
}
double value_of(const Tensor& bits) {
  double d;
  std::memcpy(&d, bits.data_ptr(), sizeof d);
  return d;
}

// ---- sums -----------------------------------------------------------------------------------

// One block (up to 2048 elements), several, and past the 1024-block cap (3000017 elements), where
// every thread's grid-stride loop goes round more than once. The largest size runs once for the
// vector loads and once for the scalar ones only: 262144 emulated threads a launch.
TEST(SimtReduce, SumAndSumOfSquaresMatchTheCpuBackend) {
  for (DType t : kFloatTypes) {
    for (int64_t n :
         {int64_t{1}, int64_t{3}, int64_t{1000}, int64_t{2049}, int64_t{70001}, int64_t{3000017}}) {
      for (Place place : kAlignments) {
        const bool vector_f32 = t == DType::F32 && place == Place::aligned;
        const bool scalar_bf16 = t == DType::BF16 && place == Place::offset;
        if (n == 3000017 && !vector_f32 && !scalar_bf16) continue;
        const Tensor x = random_cpu({n}, t, 70);
        const double s_want = cpu().sum(x), q_want = cpu().sum_squares(x);
        under_every_schedule(
            label("sum", t, n, place),
            [&](const std::string&) {
              Operand dx(x, place);
              testing::GuardedScratch scratch;
              const double s = kernels::sum(dx.data(), t, n, false, scratch, nullptr);
              const double q = kernels::sum(dx.data(), t, n, true, scratch, nullptr);
              return Results{bits_of(s), bits_of(q)};
            },
            [&](const Results& got, const std::string& run) {
              EXPECT_NEAR(value_of(got[0]), s_want, 1e-9 * q_want + 1e-9) << run << " sum";
              EXPECT_NEAR(value_of(got[1]), q_want, 1e-9 * q_want) << run << " sum of squares";
            });
      }
    }
  }
  // Nothing to sum.
  testing::GuardedScratch scratch;
  EXPECT_EQ(kernels::sum(nullptr, DType::F32, 0, true, scratch, nullptr), 0.0);
}

// Each tensor's entry is the single-tensor sum bit for bit, whatever came before it in the list
// (the partial buffer is shared), empty tensors included. 15 tensors of up to 33 blocks each in
// every dtype, then 130 small bf16 ones, 65 aligned and 65 not: more of one dtype and alignment
// than one launch takes (48), so those lists are split.
TEST(SimtReduce, SumSquaresOverAListEqualsThePerTensorSums) {
  std::vector<Tensor> host;
  const int64_t sizes[] = {1, 17, 4096, 65537, 0};
  for (int i = 0; i < 15; ++i)
    host.push_back(random_cpu({sizes[i % 5]}, kFloatTypes[i % 3], 500 + static_cast<uint64_t>(i)));
  const int64_t small_sizes[] = {1, 3, 64, 130, 8};
  for (int i = 0; i < 130; ++i)
    host.push_back(random_cpu({small_sizes[i % 5]}, DType::BF16, 700 + static_cast<uint64_t>(i)));
  under_every_schedule(
      "sum_squares_multi of 145 tensors",
      [&](const std::string&) {
        std::vector<Operand> dev;
        std::vector<kernels::TensorSpan> spans;
        for (size_t i = 0; i < host.size(); ++i) {
          dev.emplace_back(host[i], i % 2 ? Place::offset : Place::aligned);
          spans.push_back({dev.back().data(), host[i].dtype(), host[i].numel()});
        }
        std::vector<double> sums(host.size(), -1.0);
        testing::GuardedScratch scratch;
        kernels::sum_squares_multi(spans.data(), static_cast<int64_t>(spans.size()), sums.data(),
                                   scratch, nullptr);
        Results out;
        for (size_t i = 0; i < host.size(); ++i) {
          out.push_back(bits_of(sums[i]));
          out.push_back(bits_of(kernels::sum(dev[i].data(), host[i].dtype(), host[i].numel(), true,
                                             scratch, nullptr)));
        }
        return out;
      },
      [&](const Results& got, const std::string& run) {
        for (size_t i = 0; i < host.size(); ++i) {
          const double listed = value_of(got[2 * i]), alone = value_of(got[2 * i + 1]);
          EXPECT_EQ(listed, alone) << run << " tensor " << i;
          const double want = cpu().sum_squares(host[i]);
          EXPECT_NEAR(listed, want, 1e-9 * want) << run << " tensor " << i;
        }
      });
}

// ---- unscale and check ----------------------------------------------------------------------

Tensor with_value_at(const Tensor& x, int64_t i, float value) {
  std::vector<float> v = x.to_float_vector();
  v[static_cast<size_t>(i)] = value;
  return from_floats(v, x.shape(), x.dtype());
}

// x *= inv_scale is one product per element: the CPU's bits. An inf or nan anywhere is found:
// in the middle (the vector loop) and in the last element (the scalar tail of a length that is
// no multiple of the vector).
TEST(SimtReduce, UnscaleMatchesTheCpuBackendAndFindsInfAndNan) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (DType t : kFloatTypes) {
    // 65537 elements: more vectors than the 32 x 256 threads of the grid.
    for (int64_t n : {1, 17, 65537}) {
      for (Place place : kAlignments) {
        const Tensor clean = random_cpu({n}, t, 80);
        for (auto [at, value] : {std::pair{int64_t{-1}, 0.0f}, std::pair{n / 2, inf},
                                 std::pair{n / 2, nan}, std::pair{n - 1, -inf}}) {
          const Tensor x = at < 0 ? clean : with_value_at(clean, at, value);
          Tensor want = x.clone();
          const bool found_want = cpu().unscale_and_check(want, 0.125f);
          ASSERT_EQ(found_want, at >= 0);
          under_every_schedule(
              label("unscale_and_check", t, n, place) + " with " + std::to_string(value) + " at " +
                  std::to_string(at),
              [&](const std::string& run) {
                Operand dx(x, place);
                testing::GuardedScratch scratch;
                const bool found =
                    kernels::unscale_and_check(dx.data(), t, n, 0.125f, scratch, nullptr);
                dx.expect_margins_untouched(run);
                return Results{dx.to_tensor(), from_ints({found}, {1})};
              },
              [&](const Results& got, const std::string& run) {
                // Equal values; a nan's payload may differ (the 16-bit conversions of the CUDA
                // headers give the canonical nan, the CPU's keeps the float's payload bits).
                testing::expect_close(got[0], want, 0.0f, 0.0f, run);
                EXPECT_EQ(got[1].to_int_vector()[0] != 0, found_want) << run << " found";
              });
        }
      }
    }
  }
}

// Every tensor of the list is unscaled, and an inf in any one of them (first, middle or last,
// any dtype) is reported.
TEST(SimtReduce, UnscaleOverAListFindsAnInfInAnyTensor) {
  std::vector<Tensor> host;
  const int64_t sizes[] = {1, 17, 4096, 65537, 0};
  for (int i = 0; i < 15; ++i)
    host.push_back(random_cpu({sizes[i % 5]}, kFloatTypes[i % 3], 500 + static_cast<uint64_t>(i)));
  for (int bad : {-1, 0, 7, 13}) {
    std::vector<Tensor> inputs, want;
    for (size_t i = 0; i < host.size(); ++i) {
      inputs.push_back(
          static_cast<int>(i) == bad
              ? with_value_at(host[i], host[i].numel() / 2, std::numeric_limits<float>::infinity())
              : host[i]);
      want.push_back(inputs.back().clone());
      EXPECT_EQ(cpu().unscale_and_check(want.back(), 0.25f), static_cast<int>(i) == bad);
    }
    under_every_schedule(
        "unscale_and_check_multi with an inf in tensor " + std::to_string(bad),
        [&](const std::string&) {
          std::vector<Operand> dev;
          std::vector<kernels::TensorSpan> spans;
          for (size_t i = 0; i < inputs.size(); ++i) {
            dev.emplace_back(inputs[i], i % 2 ? Place::offset : Place::aligned);
            spans.push_back({dev.back().data(), inputs[i].dtype(), inputs[i].numel()});
          }
          testing::GuardedScratch scratch;
          const bool found = kernels::unscale_and_check_multi(
              spans.data(), static_cast<int64_t>(spans.size()), 0.25f, scratch, nullptr);
          Results out{from_ints({found}, {1})};
          for (const Operand& d : dev) out.push_back(d.to_tensor());
          return out;
        },
        [&](const Results& got, const std::string& run) {
          EXPECT_EQ(got[0].to_int_vector()[0] != 0, bad >= 0) << run;
          for (size_t i = 0; i < want.size(); ++i)
            testing::expect_close(got[i + 1], want[i], 0.0f, 0.0f,
                                  run + ", tensor " + std::to_string(i));
        });
  }
}

// ---- AdamW ----------------------------------------------------------------------------------

// The step's constants as the CUDA backend forms them.
kernels::AdamWConstants adamw_constants(const Backend::AdamWArgs& args) {
  return kernels::adamw_constants(args.lr, args.beta1, args.beta2, args.eps, args.weight_decay,
                                  args.step, args.grad_scale);
}

struct AdamWEntry {
  DType grad_type;
  int64_t n;
  bool decay;
  Place place;
};

// Three steps of AdamW on every entry through adamw_multi, against the CPU's per-tensor adamw:
// each element's operations are the CPU's, each rounded on its own, so the bits are equal.
void check_adamw(const std::vector<AdamWEntry>& entries, const std::string& what) {
  const Backend::AdamWArgs base{1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 1};
  std::vector<Tensor> p0, p, m, v;
  std::vector<std::vector<Tensor>> grads(entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    const AdamWEntry& e = entries[i];
    p0.push_back(random_cpu({e.n}, DType::F32, 200 + i));
    p.push_back(p0.back().clone());
    m.push_back(zeros({e.n}));
    v.push_back(zeros({e.n}));
    for (int64_t step = 1; step <= 3; ++step) {
      grads[i].push_back(random_cpu({e.n}, e.grad_type, 300 + 7 * i + static_cast<size_t>(step)));
      Backend::AdamWArgs args = base;
      args.step = step;
      args.grad_scale = step == 3 ? 0.37f : 1.0f;  // a clipped step
      if (!e.decay) args.weight_decay = 0.0f;
      cpu().adamw(p[i], grads[i].back(), m[i], v[i], args);
    }
  }
  under_every_schedule(
      what,
      [&](const std::string& run) {
        std::vector<Operand> dp, dm, dv;
        for (size_t i = 0; i < entries.size(); ++i) {
          dp.emplace_back(p0[i], entries[i].place);
          dm.emplace_back(zeros({entries[i].n}), entries[i].place);
          dv.emplace_back(zeros({entries[i].n}), entries[i].place);
        }
        for (int64_t step = 1; step <= 3; ++step) {
          Backend::AdamWArgs args = base;
          args.step = step;
          args.grad_scale = step == 3 ? 0.37f : 1.0f;  // a clipped step
          const kernels::AdamWConstants c = adamw_constants(args);
          std::vector<Operand> dg;
          std::vector<kernels::AdamWTensorRef> refs;
          for (size_t i = 0; i < entries.size(); ++i) {
            const AdamWEntry& e = entries[i];
            dg.emplace_back(grads[i][static_cast<size_t>(step - 1)], e.place);
            // Without decay the factor is exactly 1, as the CUDA backend passes it.
            refs.push_back({dp[i].f32(), dg.back().data(), e.grad_type, dm[i].f32(), dv[i].f32(),
                            e.n, e.decay ? c.decay : 1.0f});
          }
          kernels::adamw_multi(refs.data(), static_cast<int64_t>(refs.size()), c, nullptr);
        }
        Results out;
        for (size_t i = 0; i < entries.size(); ++i) {
          const std::string entry = run + " entry " + std::to_string(i);
          dp[i].expect_margins_untouched(entry + " param");
          dm[i].expect_margins_untouched(entry + " m");
          dv[i].expect_margins_untouched(entry + " v");
          out.push_back(dp[i].to_tensor());
          out.push_back(dm[i].to_tensor());
          out.push_back(dv[i].to_tensor());
        }
        return out;
      },
      [&](const Results& got, const std::string& run) {
        for (size_t i = 0; i < entries.size(); ++i) {
          const AdamWEntry& e = entries[i];
          const std::string entry = run + ", entry " + std::to_string(i) + " " +
                                    label("", e.grad_type, e.n, e.place) +
                                    (e.decay ? " decay" : " no decay");
          expect_bitwise_equal(got[3 * i], p[i], entry + " param");
          expect_bitwise_equal(got[3 * i + 1], m[i], entry + " m");
          expect_bitwise_equal(got[3 * i + 2], v[i], entry + " v");
        }
      });
}

TEST(SimtReduce, AdamWOnOneTensorMatchesTheCpuBackendBitForBit) {
  for (DType tg : kFloatTypes)
    for (int64_t n : {1, 7, 100001})
      for (Place place : kAlignments)
        check_adamw({{tg, n, true, place}}, label("adamw", tg, n, place));
}

// More tensors than one launch takes (48), every gradient dtype in one list, sizes from one
// element to several 32768-element blocks, tensors off the 16-byte alignment of the vector path,
// and weight decay on some entries only.
TEST(SimtReduce, AdamWOverAListEqualsPerTensorAdamW) {
  std::vector<AdamWEntry> entries;
  const int64_t sizes[] = {1, 3, 64, 1000, 70001};
  for (int i = 0; i < 110; ++i)
    entries.push_back({kFloatTypes[i % 3], sizes[i % 5], i % 3 != 0,
                       i % 4 == 1 ? Place::offset : Place::aligned});
  check_adamw(entries, "adamw_multi of 110 tensors");
}

}  // namespace
}  // namespace shardtrain
