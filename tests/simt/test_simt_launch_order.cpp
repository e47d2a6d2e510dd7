// kernels/launch_order.h: the longest-first numbering of a causal attention kernel's blocks.
// Every block number maps to one (rank, unit) and back, chunks hold consecutive units, and
// within a chunk the blocks come rank by rank, so every unit's longest block (rank 0) starts
// before any unit's second.
#include <gtest/gtest.h>

#include <set>
#include <utility>

#include "launch_order.h"

namespace shardtrain::kernels {
namespace {

void check_order(uint32_t ranks, uint32_t units, uint32_t chunk) {
  SCOPED_TRACE("ranks " + std::to_string(ranks) + " units " + std::to_string(units) + " chunk " +
               std::to_string(chunk));
  const LaunchOrder order{ranks, units, chunk};
  ASSERT_EQ(order.blocks(), ranks * units);
  std::set<std::pair<uint32_t, uint32_t>> seen;
  BlockSlot previous{0, 0};
  for (uint32_t linear = 0; linear < order.blocks(); ++linear) {
    const BlockSlot s = block_slot(order, linear);
    ASSERT_LT(s.rank, ranks) << "block " << linear;
    ASSERT_LT(s.unit, units) << "block " << linear;
    EXPECT_TRUE(seen.insert({s.rank, s.unit}).second)
        << "block " << linear << " repeats rank " << s.rank << " unit " << s.unit;
    const uint32_t chunk_of = s.unit / chunk;
    // Block numbers of chunk c come before those of chunk c + 1.
    EXPECT_EQ(linear / (ranks * chunk), chunk_of) << "block " << linear;
    if (linear > 0 && previous.unit / chunk == chunk_of) {
      // Within a chunk: ranks never decrease, and units cycle in order within a rank.
      EXPECT_GE(s.rank, previous.rank) << "block " << linear;
      if (s.rank == previous.rank) {
        EXPECT_EQ(s.unit, previous.unit + 1) << "block " << linear;
      }
    }
    previous = s;
  }
  EXPECT_EQ(seen.size(), static_cast<size_t>(ranks) * units);
}

TEST(LaunchOrder, EveryBlockOnceLongestFirstWithinEachChunk) {
  check_order(16, 64, 64);  // one chunk
  check_order(16, 64, 24);  // a short last chunk (64 = 24 + 24 + 16)
  check_order(1, 7, 3);     // one block a unit
  check_order(5, 1, 1);     // one unit
  check_order(32, 96, 1);   // a unit a chunk: each unit's blocks in a row
  check_order(9, 10, 100);  // chunk larger than the units (the launcher clamps it; still exact)
}

TEST(LaunchOrder, TheFirstBlocksAreEveryUnitsLongest) {
  const LaunchOrder order{16, 40, 40};
  for (uint32_t linear = 0; linear < 40; ++linear) {
    EXPECT_EQ(block_slot(order, linear).rank, 0u);
    EXPECT_EQ(block_slot(order, linear).unit, linear);
  }
  EXPECT_EQ(block_slot(order, 40).rank, 1u);
}

}  // namespace
}  // namespace shardtrain::kernels
