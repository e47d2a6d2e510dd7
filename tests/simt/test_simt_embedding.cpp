// kernels/embedding.cu on the simt emulator against the CPU backend: the lookup (vectorised and
// scalar rows, mixed dtypes), the deterministic gradient (a stable sort by id, then one ordered
// sum per distinct id; the sort is the emulator's stand-in for cub's) and the index check.
#include "simt_kernel_checks.h"

namespace shardtrain {
namespace {

using testing::cpu;
using testing::Operand;
using testing::random_cpu;

std::string label(const char* what, DType t, int64_t V, int64_t H, int64_t N) {
  return std::string(what) + " " + std::string(dtype_name(t)) + " V=" + std::to_string(V) +
         " H=" + std::to_string(H) + " N=" + std::to_string(N);
}

TEST(SimtEmbedding, LookupAndGradientMatchTheCpuBackendUnderEverySchedule) {
  for (DType t : {DType::F32, DType::BF16, DType::F16}) {
    // Many repeats (small vocabularies against many tokens) exercise the ordered per-id sums;
    // hidden sizes that are and are not multiples of the vector width; more rows than the
    // emulated grid has threads, so the grid-stride loops loop.
    for (auto [V, H, N] : {std::tuple<int64_t, int64_t, int64_t>{50, 64, 200},
                           {7, 33, 19},
                           {300, 16, 3000},
                           {3, 8, 1}}) {
      const Tensor w = random_cpu({V, H}, t, 14);
      const Tensor ids = from_ints(testing::random_ids(N, V, 15), {N});
      const Tensor dy = random_cpu({N, H}, t, 16);
      Tensor out_want = empty({N, H}, t);
      cpu().embedding_forward(w, ids, out_want);
      // The gradient accumulates into an existing one, from zero (the sums then match the CPU's
      // bit for bit: both add a row's terms in position order) and from random values.
      Tensor from_zero_want = zeros({V, H});
      cpu().embedding_backward(dy, ids, from_zero_want);
      Tensor from_random_want = random_cpu({V, H}, DType::F32, 17);
      cpu().embedding_backward(dy, ids, from_random_want);

      testing::under_every_schedule(
          label("embedding", t, V, H, N),
          [&](const std::string& run) -> std::vector<Tensor> {
            const Operand dw(w), did(ids), ddy(dy), out({N, H}, t);
            const Operand from_zero(zeros({V, H})), from_random(random_cpu({V, H}, DType::F32, 17));
            const auto* id_data = did.as<const int64_t>();
            testing::GuardedScratch scratch;
            EXPECT_EQ(kernels::first_bad_index(id_data, N, V, INT64_MIN, scratch, nullptr), -1)
                << run;
            kernels::embedding_forward(dw.data(), t, id_data, out.data(), t, N, V, H, nullptr);
            kernels::embedding_backward(ddy.data(), t, id_data, from_zero.f32(), N, V, H, scratch,
                                        nullptr);
            kernels::embedding_backward(ddy.data(), t, id_data, from_random.f32(), N, V, H, scratch,
                                        nullptr);
            return {out.to_tensor(), from_zero.to_tensor(), from_random.to_tensor()};
          },
          [&](const std::vector<Tensor>& got, const std::string& run) {
            testing::expect_bitwise_equal(got[0], out_want, "embedding_forward, " + run);
            testing::expect_bitwise_equal(got[1], from_zero_want,
                                          "embedding_backward from zero, " + run);
            testing::expect_close(got[2], from_random_want, 2e-5f, 2e-5f,
                                  "embedding_backward, " + run);
          });
    }
  }
}

TEST(SimtEmbedding, MixedDtypeLookup) {
  const Tensor w = random_cpu({10, 12}, DType::BF16, 18);
  const Tensor ids = from_ints({9, 0, 3}, {3});
  Tensor want = empty({3, 12}, DType::F32);
  cpu().embedding_forward(w, ids, want);
  const Operand dw(w), did(ids), out({3, 12}, DType::F32);
  kernels::embedding_forward(dw.data(), DType::BF16, did.as<const int64_t>(), out.data(),
                             DType::F32, 3, 10, 12, nullptr);
  testing::expect_bitwise_equal(out.to_tensor(), want, "embedding bf16 -> f32");
}

// The first offending position wins, whatever the order the threads find them in; the ignored
// id is allowed.
TEST(SimtEmbedding, FirstBadIndexFindsTheEarliestPosition) {
  std::vector<int64_t> ids(20000, 3);
  ids[17001] = 10;
  ids[9000] = -1;
  ids[12345] = -100;  // the ignored id
  ids[19999] = 11;
  const Tensor t = from_ints(ids, {static_cast<int64_t>(ids.size())});
  for (const simt::Options& schedule : testing::schedules()) {
    testing::ScheduleGuard guard(schedule);
    const Operand d(t);
    testing::GuardedScratch scratch;
    EXPECT_EQ(
        kernels::first_bad_index(d.as<const int64_t>(), t.numel(), 10, -100, scratch, nullptr),
        9000)
        << testing::describe(schedule);
  }
}

}  // namespace
}  // namespace shardtrain
