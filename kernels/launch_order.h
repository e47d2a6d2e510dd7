// The order in which a causal attention kernel numbers its blocks: longest first.
//
// The blocks of a causal kernel do unequal work: a forward or dQ block of late query rows walks
// many key tiles, one of early rows few; a dK/dV block of early keys walks many query tiles. The
// GPU starts blocks in blockIdx order as slots free up, so if the longest blocks of the last
// heads start last, the kernel waits on them at the end. Blocks are therefore numbered longest
// first ("longest processing time first"): rank 0 is every unit's longest block, then rank 1,
// and so on, with the units (heads, or parts of kv heads) side by side within a rank. Units are
// taken `chunk` at a time, a number the launcher sizes so that what a chunk's blocks read stays
// in L2 while they run, but large enough to fill the GPU several times over; each chunk is
// numbered longest first on its own.
//
// A list-scheduling model of the kernel bench's shapes (blocks dispatched in order to two slots
// an SM of an H100, each taking time in proportion to its tiles; the launcher's chunk sizes)
// ends the forward 1.07-1.59x, the dQ pass 1.04-1.29x and the dK/dV pass 1.15-1.62x earlier in
// this order than with each unit's blocks in a row (tests/bench/schedule_model.py). The model
// leaves out that a block alone on an SM runs faster, which softens a tail, so the real gain is
// smaller. Not yet timed on a GPU.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace shardtrain::kernels {

// Counts are 32-bit (the launcher keeps ranks * units below 2^31): 64-bit divisions would cost
// every block a call to a long division routine.
struct LaunchOrder {
  uint32_t ranks;  // blocks of one unit
  uint32_t units;
  uint32_t chunk;  // units numbered together, at least 1
  unsigned blocks() const { return ranks * units; }
};

struct BlockSlot {
  uint32_t rank;  // 0 = the unit's longest block
  uint32_t unit;
};

// The rank and unit of the block numbered `linear` (blockIdx.x), for linear < order.blocks().
__host__ __device__ inline BlockSlot block_slot(const LaunchOrder& order, uint32_t linear) {
  const uint32_t per_chunk = order.ranks * order.chunk;
  const uint32_t c = linear / per_chunk;
  const uint32_t first = c * order.chunk;
  const uint32_t left = order.units - first;
  const uint32_t here = left < order.chunk ? left : order.chunk;  // the last chunk may be short
  const uint32_t r = linear - c * per_chunk;
  return {r / here, first + r % here};
}

}  // namespace shardtrain::kernels
