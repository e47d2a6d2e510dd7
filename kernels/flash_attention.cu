// Fused causal attention (flash-attention algorithm) with grouped-query heads.
//
// Forward: a block owns 128 query rows of one head (8 warps x 16 rows at D = 64, 4 warps x 32
// rows at D = 128) and walks the key/value
// tiles of 64 keys up to the diagonal. Scores S = Q K^T and the product P V run on tensor cores
// (mma.sync m16n8k16, bf16/f16 inputs, fp32 accumulation); the softmax is online (running row
// max and sum in fp32 registers), so memory is O(S) and the S x S matrix never exists. The
// log-sum-exp of every row is saved for the backward pass. A row's running max is raised only
// when its scores pass it by more than 2^8 (kRescaleSlack), so most tiles skip rescaling O.
//
// Backward (FlashAttention-2 style, deterministic: no atomics):
//   delta_i = sum_d dO_i * O_i                        (one warp per row)
//   dK, dV: a block owns the keys of 4 warps (32 keys a warp at D = 64, 16 at D = 128) of one
//           kv head and loops over the query heads of its group and the query tiles at or after
//           its keys, recomputing P = exp(S - lse) and dS = P * (dO V^T - delta);
//           dV += P^T dO, dK += dS^T Q. When that grid would be small
//           (few kv heads, small batch) the group is split over several blocks, whose fp32
//           partials a last pass adds in a fixed order (group_split below).
//   dQ:     a block owns 64 query rows (128 at D = 128) and loops over key tiles up to the
//           diagonal; dQ += dS K.
// dQ is recomputed in its own pass instead of being accumulated with atomics across key blocks,
// which costs two extra matrix products per tile and makes every result bit-reproducible.
// The other form (AttentionBackwardAlgo::AtomicDq, FlashAttention-2's): the dK/dV kernel stages
// each step's dS in shared memory and adds dS K into an fp32 dQ buffer with atomics, and a last
// pass scales and rounds it; 5 products per pair of tiles instead of 7, and dQ's last bits
// depend on the order in which the hardware runs the key blocks.
//
// Data movement uses sm_80 instructions only (no wgmma or TMA), so one binary serves sm_80 and
// sm_90:
// - Tiles go from global to shared memory with cp.async (16-byte copies that skip the registers;
//   rows past the sequence are zero-filled by the copy itself) and are double-buffered: the copy
//   of the next tile is issued right after the barrier that opens the current one, so it
//   overlaps a whole tile of tensor-core work. One cp.async.wait_all + __syncthreads per tile
//   both publishes the new tile and frees the buffer that the next copy overwrites.
// - Every matrix stays row-major [row][d] in shared memory, as in global memory, and fragments
//   come from ldmatrix.x4 (four 8x8 matrices per instruction). A operands, and B operands whose
//   k dimension is d (K in Q K^T; Q, dO, K, V in the backward products over d), use the plain
//   form; B operands whose k dimension is the row (V in P V, dO and Q in P^T dO and dS^T Q, K in
//   dS K) use ldmatrix.trans, so no transposed copy is ever stored.
// - Rows are padded by 8 elements (16 bytes): the eight row reads of an 8x8 matrix then start
//   4 banks apart and cover all 32 banks, and every row start stays 16-byte aligned.
// - In the forward a warp owns one or two m-tiles of 16 rows (two at D = 128, so each K and V
//   fragment read feeds twice the products); at D = 64 its Q fragments stay in registers for
//   the whole key loop. Score accumulators of two adjacent 8-column tiles form the A fragment of P
//   for the next product, so P never leaves the registers.
// - The causal mask is applied only to tiles that cross a warp's diagonal or the end of the
//   sequence, and a warp skips tiles that lie wholly above its diagonal (it still takes part in
//   the block's copies and barriers).
//
// Tensor-core fragments follow the PTX ISA layouts for mma.m16n8k16 (groupID = lane / 4,
// tig = lane % 4): A rows groupID and groupID + 8, columns 2 tig + {0, 1} (+ 8); B columns
// groupID, rows 2 tig + {0, 1} (+ 8); C rows groupID / groupID + 8, columns 2 tig + {0, 1}.
//
// Under SHARDTRAIN_SIMT (tests/simt: the kernels compiled for the CPU emulator) the helpers below
// call the emulator's models of these instructions instead of inline PTX.
//
// Other cases (f32, head dims other than 64 and 128, misaligned pointers) run on CUDA-core
// kernels with one warp per row: exact fp32, deterministic, but much slower.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <type_traits>

#include "common.cuh"
#include "launch_order.h"

namespace shardtrain::kernels {

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
// How far (log2 units) the forward lets a row's scores pass its running max before raising it:
// probabilities stay below 2^8 = 256, which bf16, f16 and the fp32 sums hold with room to spare.
constexpr float kRescaleSlack = 8.0f;

// ---- tensor-core helpers --------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<bf16>(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
  return *reinterpret_cast<const uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<f16>(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// c += a * b for one 16x8x16 tile.
template <typename T>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, bf16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#elif defined(SHARDTRAIN_SIMT)
  simt::mma_m16n8k16(std::is_same_v<T, bf16>, c, a, b);
#else
  __trap();  // the host code never launches these kernels below sm_80
#endif
}

// 2^x with the hardware's approximation (ex2.approx, relative error about 2^-22), subnormal
// inputs and results flushed to zero. exp2f compiles to the same MUFU.EX2 guarded by three more
// instructions that keep subnormal results (counted in sm_90 SASS: 3 per call), and a softmax
// issues one per score, as many as its other arithmetic. A probability below 2^-126 adds nothing
// that bf16 or f16 products could hold.
__device__ __forceinline__ float exp2_ftz(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
#else
  const float y = exp2f(x);  // the emulator and host passes: exact, flushed as the hardware does
  return y < 1.17549435e-38f ? 0.0f : y;
#endif
}

// The accumulators of two adjacent 8-column tiles, c0 and c1 (rows g and g + 8, columns
// 2 tig + {0, 1}), as the A fragment of a 16-wide k step of the next product: rounded to T, they
// sit exactly where mma.m16n8k16 expects A's columns 0-7 and 8-15, so P and dS never leave the
// registers.
template <typename T>
__device__ __forceinline__ void accumulators_as_a(uint32_t (&a)[4], const float (&c0)[4],
                                                  const float (&c1)[4]) {
  a[0] = pack2<T>(c0[0], c0[1]);
  a[1] = pack2<T>(c0[2], c0[3]);
  a[2] = pack2<T>(c1[0], c1[1]);
  a[3] = pack2<T>(c1[2], c1[3]);
}

// ---- ldmatrix and cp.async (sm_80+) ---------------------------------------------------------

#if !defined(SHARDTRAIN_SIMT)
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
#endif

// ldmatrix.x4: lane l supplies the address of row (l % 8) of 8x8 matrix l / 8 (16 bytes, 16-byte
// aligned); register i of every lane receives its mma fragment of matrix i: row lane / 4, columns
// 2 (lane % 4) + {0, 1}. With .trans the lane receives column lane / 4, rows 2 (lane % 4) + {0, 1}
// instead, which turns a row-major [k][n] tile into a B fragment without a transposed copy.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const uint16_t* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
#elif defined(SHARDTRAIN_SIMT)
  simt::ldmatrix_x4(r, p, false);
#else
  __trap();
#endif
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const uint16_t* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
#elif defined(SHARDTRAIN_SIMT)
  simt::ldmatrix_x4(r, p, true);
#else
  __trap();
#endif
}

// Asynchronous global -> shared copy of 16 bytes (cp.async.cg: through L2 only). With `valid`
// false the source size is 0: nothing is read and the 16 bytes are zero-filled, which pads a
// tile past the end of the sequence (the address passed is then any valid one).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
#elif defined(SHARDTRAIN_SIMT)
  simt::cp_async(dst, src, 16, valid ? 16 : 0);
#else
  __trap();
#endif
}
// The same for 4 bytes (cp.async.ca), for per-row floats whose rows are not 16-byte aligned.
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 4 : 0)
               : "memory");
#elif defined(SHARDTRAIN_SIMT)
  simt::cp_async(dst, src, 4, valid ? 4 : 0);
#else
  __trap();
#endif
}
// Closes the group of copies issued so far by this thread.
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
// Waits until this thread's copies have landed. Other threads see them only after a barrier.
__device__ __forceinline__ void cp_async_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#elif defined(SHARDTRAIN_SIMT)
  simt::cp_async_wait_all();
#endif
}

// Rows [row0, row0 + ROWS) of a [seq, D] matrix into shared [ROWS][LD] with cp.async, 16 bytes
// per copy spread over the NT threads of the block; rows past seq are zero-filled.
template <int ROWS, int D, int LD, int NT>
__device__ __forceinline__ void copy_rows_async(uint16_t* dst, const uint16_t* src, int64_t row0,
                                                int64_t seq) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  static_assert((ROWS * kChunks) % NT == 0, "every thread issues the same number of copies");
#pragma unroll
  for (int idx = threadIdx.x; idx < ROWS * kChunks; idx += NT) {
    const int r = idx / kChunks, c = (idx % kChunks) * 8;
    const bool valid = row0 + r < seq;
    cp_async16(dst + r * LD + c, valid ? src + (row0 + r) * D + c : src, valid);
  }
}

// Reduction over the four lanes (a quad) that share an mma row.
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// One 16-wide slice `kc` of d of the two products that both backward passes form side by side
// (S and dP, or their transposes): acc_x += A_x Y^T and acc_z += A_z W^T for every m-tile, where
// the A fragments are given per m-tile and Y and W are row-major [column][d] tiles in shared
// memory (LD elements a row), read as B fragments of two 8-column tiles per ldmatrix.x4, each
// fed to the products of every m-tile. lr and lm: the lane's ldmatrix row and matrix.
template <typename T, int MI, int COLS, int LD>
__device__ __forceinline__ void paired_products_slice(
    float (&acc_x)[MI][COLS / 8][4], float (&acc_z)[MI][COLS / 8][4], const uint32_t (&a_x)[MI][4],
    const uint32_t (&a_z)[MI][4], const uint16_t* y, const uint16_t* w, int kc, int lr, int lm) {
#pragma unroll
  for (int np = 0; np < COLS / 16; ++np) {
    uint32_t yf[4], wf[4];
    const int row = (np * 16 + (lm >> 1) * 8 + lr) * LD + kc * 16 + (lm & 1) * 8;
    ldsm_x4(yf, y + row);
    ldsm_x4(wf, w + row);
    const uint32_t by0[2] = {yf[0], yf[1]}, by1[2] = {yf[2], yf[3]};
    const uint32_t bw0[2] = {wf[0], wf[1]}, bw1[2] = {wf[2], wf[3]};
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
      mma<T>(acc_x[mi][2 * np], a_x[mi], by0);
      mma<T>(acc_x[mi][2 * np + 1], a_x[mi], by1);
      mma<T>(acc_z[mi][2 * np], a_z[mi], bw0);
      mma<T>(acc_z[mi][2 * np + 1], a_z[mi], bw1);
    }
  }
}

// acc[mi] += P[mi] Y for every m-tile, where P (MI m-tiles of 16 rows x KEYS columns) is held
// in registers as the accumulators of the product before it (rounded to T on the way) and Y is a
// row-major [key][d] tile in shared memory (LD elements a row). One ldmatrix.x4.trans gives the B
// fragments of two 8-wide d tiles: matrices 0, 1 = keys 16 kc + 0-7 / + 8-15 at d 16 dp + 0-7,
// matrices 2, 3 at d + 8-15; each feeds the products of every m-tile. O += P V in the forward,
// dQ += dS K in the dQ pass.
template <typename T, int MI, int KEYS, int D, int LD>
__device__ __forceinline__ void held_times_rows(float (&acc)[MI][D / 8][4],
                                                const float (&p)[MI][KEYS / 8][4],
                                                const uint16_t* y, int lr, int lm) {
#pragma unroll
  for (int kc = 0; kc < KEYS / 16; ++kc) {
    uint32_t a[MI][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) accumulators_as_a<T>(a[mi], p[mi][2 * kc], p[mi][2 * kc + 1]);
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t yf[4];
      ldsm_x4_trans(yf, y + (kc * 16 + (lm & 1) * 8 + lr) * LD + dp * 16 + (lm >> 1) * 8);
      const uint32_t b0[2] = {yf[0], yf[1]}, b1[2] = {yf[2], yf[3]};
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        mma<T>(acc[mi][2 * dp], a[mi], b0);
        mma<T>(acc[mi][2 * dp + 1], a[mi], b1);
      }
    }
  }
}

// Every accumulator of a set of M x N (or N) mma tiles to zero.
template <int M, int N>
__device__ __forceinline__ void zero_tiles(float (&acc)[M][N][4]) {
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.0f;
}
template <int N>
__device__ __forceinline__ void zero_tiles(float (&acc)[N][4]) {
#pragma unroll
  for (int n = 0; n < N; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
}

// The head of step kt of a loop over KEYS-key tiles of K and V, double-buffered (buffer b of K
// at ks + b * stage, of V at vs + b * stage): waits for tile kt, then, once every warp is done
// with tile kt - 1 (whose buffers it overwrites), starts the copy of tile kt + 1.
template <int KEYS, int D, int LD, int NT>
__device__ __forceinline__ void begin_kv_step(uint16_t* ks, uint16_t* vs, int stage,
                                              const uint16_t* kb, const uint16_t* vb, int64_t kt,
                                              int64_t tiles, int64_t seq) {
  cp_async_wait_all();
  __syncthreads();
  if (kt + 1 < tiles) {
    const int next = (kt + 1) & 1;
    copy_rows_async<KEYS, D, LD, NT>(ks + next * stage, kb, (kt + 1) * KEYS, seq);
    copy_rows_async<KEYS, D, LD, NT>(vs + next * stage, vb, (kt + 1) * KEYS, seq);
    cp_async_commit();
  }
}

// ---- block order: longest first (launch_order.h) -------------------------------------------

__device__ __forceinline__ BlockSlot this_block_slot(const LaunchOrder& order) {
  return block_slot(order, blockIdx.x);
}

// The block of a forward or dQ kernel: units are the flattened [B, Hq] query heads, and a head's
// longest block (rank 0) holds its last query tile, which sees the most keys.
struct QueryBlock {
  int64_t tile;     // query tile
  int64_t head;     // [B, Hq] query head
  int64_t kv_head;  // [B, Hkv] kv head whose K and V it reads
};

__device__ __forceinline__ QueryBlock query_block(const LaunchOrder& order, int heads_q,
                                                  int group) {
  const BlockSlot slot = this_block_slot(order);
  const uint32_t hq = static_cast<uint32_t>(heads_q), g = static_cast<uint32_t>(group);
  return {static_cast<int64_t>(order.ranks - 1 - slot.rank), static_cast<int64_t>(slot.unit),
          static_cast<int64_t>(slot.unit / hq * (hq / g) + slot.unit % hq / g)};
}

// ---- tensor-core forward --------------------------------------------------------------------

// A block owns 128 query rows and walks the key/value tiles of 64 keys up to the diagonal; K and
// V are double-buffered: the copy of tile kt + 1 runs while tile kt is multiplied. A warp owns
// kMTiles m-tiles of 16 rows: every K or V fragment it reads from shared memory then feeds
// kMTiles products, which is what bounds the loop when the fragments outnumber the products.
// - D = 64: 8 warps x 16 rows; the warp's Q fragments stay in registers for the whole key loop
//   (16 registers), and two blocks fit an SM in 128 registers a thread.
// - D = 128: 4 warps x 32 rows (O alone takes 128 registers a thread), Q fragments re-read from
//   shared memory for each 16 columns of d; two blocks of 4 warps share an SM, so one block's
//   softmax overlaps the other's products. On an H100 this took the D = 128 forward from 0.364
//   to 0.316 ms (B=4 H=16 S=2048) against 8 warps x 16 rows; key tiles of 32 took 0.346 ms.
template <int D>
struct FwdTiles {
  static constexpr int kMTiles = D <= 64 ? 1 : 2;
  static constexpr int kWarps = D <= 64 ? 8 : 4, kThreads = 32 * kWarps;
  static constexpr int kWarpRows = 16 * kMTiles;
  static constexpr int kRows = kWarpRows * kWarps, kKeys = 64, kLd = D + 8;
  static constexpr bool kQInRegisters = kMTiles == 1;
  static constexpr int kStage = kKeys * kLd;  // elements of one K or V buffer
  static constexpr int kMinBlocks = 2;
  static constexpr size_t kSmem = sizeof(uint16_t) * (kRows * kLd + 4 * kStage);
};

template <typename T, int D>
__global__ void __launch_bounds__(FwdTiles<D>::kThreads, FwdTiles<D>::kMinBlocks)
    flash_forward_kernel(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out,
                         float* lse, int heads_q, int group, int64_t seq, float scale_log2,
                         LaunchOrder order) {
  using Tiles = FwdTiles<D>;
  constexpr int BR = Tiles::kRows, BC = Tiles::kKeys, LD = Tiles::kLd, NT = Tiles::kThreads;
  constexpr int MI = Tiles::kMTiles, WR = Tiles::kWarpRows;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint16_t* qs = reinterpret_cast<uint16_t*>(smem_raw);
  uint16_t* ks = qs + BR * LD;            // K stages 0 and 1
  uint16_t* vs = ks + 2 * Tiles::kStage;  // V stages 0 and 1

  const auto [tile, head, kv_head] = query_block(order, heads_q, group);
  const uint16_t* qb = q + head * seq * D;
  const uint16_t* kb = k + kv_head * seq * D;
  const uint16_t* vb = v + kv_head * seq * D;
  const int64_t q0 = tile * BR;
  const int64_t tiles = (min(q0 + BR, seq) - 1) / BC + 1;

  // Q and the first key tile form the first group of copies.
  copy_rows_async<BR, D, LD, NT>(qs, qb, q0, seq);
  copy_rows_async<BC, D, LD, NT>(ks, kb, 0, seq);
  copy_rows_async<BC, D, LD, NT>(vs, vb, 0, seq);
  cp_async_commit();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  // ldmatrix.x4 addressing: this lane supplies row `lr` of 8x8 matrix `lm`.
  const int lr = lane & 7, lm = lane >> 3;
  const int64_t warp_row0 = q0 + warp * WR;
  // Rows of m-tile mi: row_a(mi) = warp_row0 + 16 mi + g and row_a(mi) + 8.
  // A fragment of Q (m-tile mi, columns 16 kc..): matrices 0..3 = rows 0-7 / 8-15 of columns
  // 16 kc + 0-7, then of + 8-15.
  const uint16_t* q_frag = qs + (warp * WR + (lm & 1) * 8 + lr) * LD + (lm >> 1) * 8;
  uint32_t qf[Tiles::kQInRegisters ? D / 16 : 1][4];  // Q in registers when it fits
  float m_run[MI][2], l_run[MI][2];  // running max (log2 domain) and per-lane partial sums
  float o[MI][D / 8][4];
  zero_tiles(o);
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
    m_run[mi][0] = m_run[mi][1] = -INFINITY;
    l_run[mi][0] = l_run[mi][1] = 0.0f;
  }

  for (int64_t kt = 0; kt < tiles; ++kt) {
    begin_kv_step<BC, D, LD, NT>(ks, vs, Tiles::kStage, kb, vb, kt, tiles, seq);
    if constexpr (Tiles::kQInRegisters) {
      if (kt == 0) {
#pragma unroll
        for (int kc = 0; kc < D / 16; ++kc) ldsm_x4(qf[kc], q_frag + kc * 16);
      }
    }
    const int64_t k0 = kt * BC;
    // Warp-uniform: keys past all of this warp's rows (or rows past the sequence) add nothing.
    if (warp_row0 >= seq || k0 > warp_row0 + WR - 1) continue;
    const uint16_t* kst = ks + (kt & 1) * Tiles::kStage;
    const uint16_t* vst = vs + (kt & 1) * Tiles::kStage;

    // S = Q K^T. One ldmatrix.x4 of K (row-major [key][d]) gives the B fragments of two 8-key
    // tiles: matrices 0, 1 = keys 16 np + 0-7 at d 16 kc + 0-7 / + 8-15, matrices 2, 3 = keys
    // 16 np + 8-15; each feeds the products of every m-tile.
    float s[MI][BC / 8][4];
    zero_tiles(s);
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
      uint32_t qa[MI][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        if constexpr (Tiles::kQInRegisters) {
#pragma unroll
          for (int e = 0; e < 4; ++e) qa[mi][e] = qf[kc][e];
        } else {
          ldsm_x4(qa[mi], q_frag + mi * 16 * LD + kc * 16);
        }
      }
#pragma unroll
      for (int np = 0; np < BC / 16; ++np) {
        uint32_t kf[4];
        ldsm_x4(kf, kst + (np * 16 + (lm >> 1) * 8 + lr) * LD + kc * 16 + (lm & 1) * 8);
        const uint32_t b0[2] = {kf[0], kf[1]}, b1[2] = {kf[2], kf[3]};
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
          mma<T>(s[mi][2 * np], qa[mi], b0);
          mma<T>(s[mi][2 * np + 1], qa[mi], b1);
        }
      }
    }

    // Mask keys after the query and past the sequence: only tiles that cross this warp's
    // diagonal or the end of the sequence need it.
    if (k0 + BC - 1 > warp_row0 || k0 + BC > seq) {
      // In 32 bits, relative to the tile's first key: this warp's first row (capped where no
      // key of the tile can pass it) and the first key past the sequence.
      const int row0 = static_cast<int>(min(warp_row0 - k0, static_cast<int64_t>(BC)));
      const int key_end = static_cast<int>(min(seq - k0, static_cast<int64_t>(BC)));
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        const int row_a = row0 + 16 * mi + g, row_b = row_a + 8;
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = nt * 8 + 2 * t4 + (e & 1);
            if (key > (e < 2 ? row_a : row_b) || key >= key_end) s[mi][nt][e] = -INFINITY;
          }
        }
      }
    }
    // Online softmax in the log2 domain: p = exp2(s * scale_log2 - m), one FFMA per score.
    // The running max m is raised lazily: only when a row's new scores pass it by more than
    // kRescaleSlack (the first tile always does), so p stays below 2^kRescaleSlack and the
    // softmax is still exact: O and l are scaled by the same 2^(-m) and lse adds m back. Most
    // tiles then leave every row's m alone and the warp skips rescaling O (D / 2 multiplies a
    // lane per m-tile, as many as the exponentials).
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
      float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < BC / 8; ++nt) {
        mx_a = fmaxf(mx_a, fmaxf(s[mi][nt][0], s[mi][nt][1]));
        mx_b = fmaxf(mx_b, fmaxf(s[mi][nt][2], s[mi][nt][3]));
      }
      mx_a = quad_max(mx_a) * scale_log2;
      mx_b = quad_max(mx_b) * scale_log2;
      // A warp raises the max of all its rows when one of them needs it (-inf + slack is -inf:
      // a row's first visible key always does), and then rescales O and l by alpha.
      if (__any_sync(0xffffffffu,
                     mx_a > m_run[mi][0] + kRescaleSlack || mx_b > m_run[mi][1] + kRescaleSlack)) {
        const float new_a = fmaxf(m_run[mi][0], mx_a), new_b = fmaxf(m_run[mi][1], mx_b);
        // Key 0 is visible to every row, so the max is finite after the first tile (a tile that
        // masks a whole m-tile comes after it); the guard keeps exp2(-inf - -inf) out regardless.
        const float alpha_a = new_a == -INFINITY ? 1.0f : exp2_ftz(m_run[mi][0] - new_a);
        const float alpha_b = new_b == -INFINITY ? 1.0f : exp2_ftz(m_run[mi][1] - new_b);
        m_run[mi][0] = new_a;
        m_run[mi][1] = new_b;
        l_run[mi][0] *= alpha_a;
        l_run[mi][1] *= alpha_b;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
          o[mi][dt][0] *= alpha_a;
          o[mi][dt][1] *= alpha_a;
          o[mi][dt][2] *= alpha_b;
          o[mi][dt][3] *= alpha_b;
        }
      }
      const float base_a = m_run[mi][0] == -INFINITY ? 0.0f : m_run[mi][0];
      const float base_b = m_run[mi][1] == -INFINITY ? 0.0f : m_run[mi][1];
      // Per-lane partial row sums: the four lanes of a row share its max and alpha, so the
      // partials are combined once at the end.
#pragma unroll
      for (int nt = 0; nt < BC / 8; ++nt) {
        s[mi][nt][0] = exp2_ftz(fmaf(s[mi][nt][0], scale_log2, -base_a));
        s[mi][nt][1] = exp2_ftz(fmaf(s[mi][nt][1], scale_log2, -base_a));
        s[mi][nt][2] = exp2_ftz(fmaf(s[mi][nt][2], scale_log2, -base_b));
        s[mi][nt][3] = exp2_ftz(fmaf(s[mi][nt][3], scale_log2, -base_b));
        l_run[mi][0] += s[mi][nt][0] + s[mi][nt][1];
        l_run[mi][1] += s[mi][nt][2] + s[mi][nt][3];
      }
    }

    // O += P V: the probabilities stay in registers; V is row-major [key][d].
    held_times_rows<T, MI, BC, D, LD>(o, s, vst, lr, lm);
  }

  uint16_t* ob = out + head * seq * D;
  float* lb = lse + head * seq;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = warp_row0 + 16 * mi + g + 8 * half;
      const float l = quad_sum(l_run[mi][half]);  // every lane of the warp takes part
      if (row >= seq) continue;
      const float inv = 1.0f / l;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt)
        *reinterpret_cast<uint32_t*>(ob + row * D + dt * 8 + 2 * t4) =
            pack2<T>(o[mi][dt][2 * half] * inv, o[mi][dt][2 * half + 1] * inv);
      if (t4 == 0) lb[row] = (m_run[mi][half] + log2f(l)) * kLn2;
    }
  }
}

// ---- tensor-core backward: dK and dV --------------------------------------------------------

// A block owns the keys of 4 warps, kMTiles m-tiles of 16 keys a warp, of one kv head, and walks
// the query tiles at or after its keys, for every query head of its group, as one sequence of
// steps; the Q and dO tiles of a step (with their lse and delta) are double-buffered.
// - kMTiles = 2 (the default at D = 64): 32 keys a warp, 128 a block, query tiles of 32. Every
//   Q and dO fragment read from shared memory feeds two products, as K and V do in the forward
//   at D = 128: 48 ldmatrix for 128 products per warp and step, where one m-tile takes 64 (with
//   its K and V fragments held in registers) for the same work. The accumulators take 128
//   registers, and two blocks still fit an SM.
// - kMTiles = 1: 16 keys a warp, 64 a block; query tiles of 64 rows at D = 64, with the warp's
//   K and V fragments in registers for all its steps, and of 32 at D = 128, where the dK and
//   dV accumulators alone take 128 registers a thread (the only form there).
template <int D, int MI>
struct DkDvTiles {
  static constexpr int kD = D;
  static constexpr int kWarps = 4, kThreads = 32 * kWarps, kWarpKeys = 16 * MI;
  static constexpr int kKeys = kWarpKeys * kWarps, kRows = D <= 64 && MI == 1 ? 64 : 32;
  static constexpr int kLd = D + 8;
  static constexpr int kStage = kRows * kLd;  // elements of one Q or dO buffer
  static constexpr size_t kHalfWords = 2 * kKeys * kLd + 4 * kStage;
  static constexpr size_t kSmem = sizeof(uint16_t) * kHalfWords + sizeof(float) * 4 * kRows;
  // The one-pass variant (atomic dQ) also stages the block's dS^T, [kKeys][kRows] padded by 8
  // as every other tile, so that all warps can read all of its keys for dQ += dS K. In that
  // product warp w owns query rows 16 (w % kDqWarpsM).. and kDqCols columns of d.
  static constexpr int kDsLd = kRows + 8;
  static constexpr size_t kSmemFusedDq = kSmem + sizeof(uint16_t) * kKeys * kDsLd;
  static constexpr int kDqWarpsM = kRows / 16;
  static constexpr int kDqCols = D * kDqWarpsM / kWarps;
  // The warp's K and V fragments (32 registers at D = 64) in registers for all its steps, which
  // takes 8 of the 72 ldmatrix of a step off shared memory.
  static constexpr bool kKVInRegisters = D <= 64 && MI == 1;
  static_assert(kDqCols % 16 == 0 && kWarps % kDqWarpsM == 0, "dQ product tiles cover D");
  static_assert(MI == 1 || D <= 64, "two key m-tiles a warp need 256 accumulators at D = 128");
};

// The key m-tiles a warp of the dK/dV kernel takes unless told otherwise.
constexpr int default_dkdv_m_tiles(int64_t head_dim) {
  return head_dim <= 64 ? 2 : 1;
}

// p[0] += a, p[1] += b as atomics (p 8-byte aligned): one vector atomic on sm_90, two below.
__device__ __forceinline__ void atomic_add_pair(float* p, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(p), make_float2(a, b));
#else
  atomicAdd(p, a);
  atomicAdd(p + 1, b);
#endif
}

// dQ[q0 .., :] += dS K for one step of the one-pass backward: dS^T is staged [key][query] in
// `ds_s` (so ldmatrix.trans gives the A fragments of dS) and K is the block's [key][d] tile (B
// fragments through ldmatrix.trans, as in the dQ pass). Each element is added by one lane of the
// block, with one atomic add to the fp32 accumulator per element and step (pairs of elements
// per atomic on sm_90).
template <typename T, typename Tiles>
__device__ __forceinline__ void accumulate_dq_tile(const uint16_t* ds_s, const uint16_t* ks,
                                                   float* dq_head, int64_t q0, int64_t seq) {
  constexpr int D = Tiles::kD, BK = Tiles::kKeys, LD = Tiles::kLd, LDS = Tiles::kDsLd;
  constexpr int NC = Tiles::kDqCols;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const int lr = lane & 7, lm = lane >> 3;
  const int wm = warp % Tiles::kDqWarpsM, wn = warp / Tiles::kDqWarpsM;
  if (q0 + wm * 16 >= seq) return;  // warp-uniform: the m-tile lies past the sequence
  const int64_t row_a = q0 + wm * 16 + g, row_b = row_a + 8;
  float acc[NC / 8][4];
  zero_tiles(acc);
#pragma unroll
  for (int kc = 0; kc < BK / 16; ++kc) {
    // Matrices 0..3 = (queries 0-7 / 8-15) x (keys 0-7), then x (keys 8-15), each stored as
    // 8 key rows of 8 queries.
    uint32_t a[4];
    ldsm_x4_trans(a, ds_s + (kc * 16 + (lm >> 1) * 8 + lr) * LDS + wm * 16 + (lm & 1) * 8);
#pragma unroll
    for (int dp = 0; dp < NC / 16; ++dp) {
      uint32_t kf[4];
      ldsm_x4_trans(kf,
                    ks + (kc * 16 + (lm & 1) * 8 + lr) * LD + wn * NC + dp * 16 + (lm >> 1) * 8);
      const uint32_t b0[2] = {kf[0], kf[1]}, b1[2] = {kf[2], kf[3]};
      mma<T>(acc[2 * dp], a, b0);
      mma<T>(acc[2 * dp + 1], a, b1);
    }
  }
#pragma unroll
  for (int n = 0; n < NC / 8; ++n) {
    const int col = wn * NC + n * 8 + 2 * t4;
    if (row_a < seq) atomic_add_pair(dq_head + row_a * D + col, acc[n][0], acc[n][1]);
    if (row_b < seq) atomic_add_pair(dq_head + row_b * D + col, acc[n][2], acc[n][3]);
  }
}

// Two adjacent elements of a row: into an fp32 buffer as they are, into a T tensor rounded.
template <typename T>
__device__ __forceinline__ void store_pair(float* p, float a, float b) {
  *reinterpret_cast<float2*>(p) = make_float2(a, b);
}
template <typename T>
__device__ __forceinline__ void store_pair(uint16_t* p, float a, float b) {
  *reinterpret_cast<uint32_t*>(p) = pack2<T>(a, b);
}

// This lane's rows (key_a and key_b) of one m-tile of the dK/dV kernel's accumulators into
// [seq][D] rows at dkb and dvb, dK scaled: the results (Out = uint16_t) or one part's fp32
// partials (Out = float).
template <typename T, int D, typename Out>
__device__ __forceinline__ void store_dk_dv(Out* dkb, Out* dvb, const float (&dk_acc)[D / 8][4],
                                            const float (&dv_acc)[D / 8][4], int64_t key_a,
                                            int64_t key_b, int64_t seq, float scale) {
  const int t4 = threadIdx.x & 3;
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
    const int col = dt * 8 + 2 * t4;
    if (key_a < seq) {
      store_pair<T>(dkb + key_a * D + col, dk_acc[dt][0] * scale, dk_acc[dt][1] * scale);
      store_pair<T>(dvb + key_a * D + col, dv_acc[dt][0], dv_acc[dt][1]);
    }
    if (key_b < seq) {
      store_pair<T>(dkb + key_b * D + col, dk_acc[dt][2] * scale, dk_acc[dt][3] * scale);
      store_pair<T>(dvb + key_b * D + col, dv_acc[dt][2], dv_acc[dt][3]);
    }
  }
}

// kFuseDq = false: dK and dV only (the deterministic backward; dQ is its own pass).
// kFuseDq = true: also dQ, FlashAttention-2's way: after dV and dK, each step's dS^T goes to
// shared memory and the block adds dS K for the step's query tile into `dq_accum` (fp32,
// unscaled, zeroed beforehand) with atomics. That saves the dQ pass's recomputation of S and dP
// (5 products per pair of tiles instead of 7), but the order in which key blocks add to a query
// row is the hardware's, so dQ is not bit-reproducible; dK and dV still are.
template <typename T, int D, int MI, bool kFuseDq>
__global__ void __launch_bounds__(DkDvTiles<D, MI>::kThreads)
    flash_backward_dkdv_kernel(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                               const uint16_t* dout, const float* lse_log2, const float* delta,
                               uint16_t* dk, uint16_t* dv, float* dk_part, float* dv_part,
                               float* dq_accum, int heads_q, int group, int split, int64_t seq,
                               float scale_log2, float scale, LaunchOrder order) {
  using Tiles = DkDvTiles<D, MI>;
  constexpr int BK = Tiles::kKeys, BQ = Tiles::kRows, LD = Tiles::kLd, NT = Tiles::kThreads;
  constexpr int WK = Tiles::kWarpKeys;
  static_assert(2 * BQ <= NT, "one thread per lse and delta row");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint16_t* ks = reinterpret_cast<uint16_t*>(smem_raw);
  uint16_t* vs = ks + BK * LD;
  uint16_t* qs = vs + BK * LD;             // Q stages 0 and 1
  uint16_t* dos = qs + 2 * Tiles::kStage;  // dO stages 0 and 1
  float* lse_s = reinterpret_cast<float*>(smem_raw + sizeof(uint16_t) * Tiles::kHalfWords);
  // lse_s (log2 domain) and delta_s: [2][BQ], 8-byte aligned (kHalfWords is a multiple of 4).
  float* delta_s = lse_s + 2 * BQ;
  uint16_t* ds_s = reinterpret_cast<uint16_t*>(delta_s + 2 * BQ);  // [BK][kDsLd], kFuseDq only

  // Units are the parts of the [B, Hkv] kv heads (unit = kv_head * split + part); a unit's
  // longest block holds its first keys, which every later query sees.
  const BlockSlot slot = this_block_slot(order);
  const int64_t k0 = static_cast<int64_t>(slot.rank) * BK;
  const int64_t kv_head = slot.unit / static_cast<uint32_t>(split);
  const int part = static_cast<int>(slot.unit % static_cast<uint32_t>(split));
  // This block's query heads: part `part` of the `split` equal parts of the group.
  const int heads_here = group / split;
  const int64_t head0 = kv_head * group + part * heads_here;
  const int64_t first_tile = k0 / BQ;  // earlier queries cannot see these keys
  const int q_tiles = static_cast<int>((seq + BQ - 1) / BQ - first_tile);
  const int steps = heads_here * q_tiles;

  // Step i: query head head0 + i / q_tiles, tile first_tile + i % q_tiles, into stage i & 1.
  auto load_step = [&](int i) {
    const int64_t head = head0 + i / q_tiles;
    const int64_t q0 = (first_tile + i % q_tiles) * BQ;
    const int stage = i & 1;
    copy_rows_async<BQ, D, LD, NT>(qs + stage * Tiles::kStage, q + head * seq * D, q0, seq);
    copy_rows_async<BQ, D, LD, NT>(dos + stage * Tiles::kStage, dout + head * seq * D, q0, seq);
    if (threadIdx.x < 2 * BQ) {  // lse and delta rows; past seq they are zero (and masked)
      const int r = threadIdx.x % BQ;
      const bool is_lse = threadIdx.x < BQ, valid = q0 + r < seq;
      const float* src = (is_lse ? lse_log2 : delta) + head * seq;
      cp_async4((is_lse ? lse_s : delta_s) + stage * BQ + r, valid ? src + q0 + r : src, valid);
    }
  };
  copy_rows_async<BK, D, LD, NT>(ks, k + kv_head * seq * D, k0, seq);
  copy_rows_async<BK, D, LD, NT>(vs, v + kv_head * seq * D, k0, seq);
  load_step(0);
  cp_async_commit();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const int lr = lane & 7, lm = lane >> 3;  // ldmatrix.x4: row lr of matrix lm
  // Keys of m-tile mi: warp_key0 + 16 mi + g and + 8.
  const int64_t warp_key0 = k0 + warp * WK, key_lane = warp_key0 + g;
  float dk_acc[MI][D / 8][4], dv_acc[MI][D / 8][4];
  zero_tiles(dk_acc);
  zero_tiles(dv_acc);

  // This lane's ldmatrix address in the block's K and V tiles (A fragments of the warp's keys,
  // m-tile 0), and the fragments themselves for the whole loop when they fit.
  const int kv_frag = (warp * WK + (lm & 1) * 8 + lr) * LD + (lm >> 1) * 8;
  constexpr int kHeld = Tiles::kKVInRegisters ? D / 16 : 1;
  uint32_t k_held[kHeld][4], v_held[kHeld][4];

  for (int i = 0; i < steps; ++i) {
    cp_async_wait_all();
    __syncthreads();  // step i is visible; every warp is done with step i - 1's buffers
    if (i + 1 < steps) {
      load_step(i + 1);
      cp_async_commit();
    }
    if constexpr (Tiles::kKVInRegisters) {
      if (i == 0) {
#pragma unroll
        for (int kc = 0; kc < kHeld; ++kc) {
          ldsm_x4(k_held[kc], ks + kv_frag + kc * 16);
          ldsm_x4(v_held[kc], vs + kv_frag + kc * 16);
        }
      }
    }
    const int64_t q0 = (first_tile + i % q_tiles) * BQ;
    // Warp-uniform: keys after every query of the tile (or past seq) get nothing from it. Such
    // a warp skips the step, except that with kFuseDq it stages zeros as its rows of dS^T and
    // joins the block's dQ product.
    const bool active = warp_key0 < seq && warp_key0 <= q0 + BQ - 1;
    if constexpr (!kFuseDq) {
      if (!active) continue;
    }
    const uint16_t* qst = qs + (i & 1) * Tiles::kStage;
    const uint16_t* dost = dos + (i & 1) * Tiles::kStage;
    const float* lse_t = lse_s + (i & 1) * BQ;
    const float* delta_t = delta_s + (i & 1) * BQ;

    // S^T = K Q^T and dP^T = V dO^T for this warp's keys x BQ queries. K and V rows are A
    // fragments; Q and dO (row-major [query][d]) give B fragments of two 8-query tiles per
    // ldmatrix.x4, as K does in the forward, each feeding the products of every m-tile.
    float st[MI][BQ / 8][4], dpt[MI][BQ / 8][4];
    zero_tiles(st);
    zero_tiles(dpt);
    if (active) {
#pragma unroll
      for (int kc = 0; kc < D / 16; ++kc) {
        uint32_t ak[MI][4], av[MI][4];
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
          if constexpr (Tiles::kKVInRegisters) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              ak[mi][e] = k_held[kc][e];
              av[mi][e] = v_held[kc][e];
            }
          } else {
            ldsm_x4(ak[mi], ks + kv_frag + mi * 16 * LD + kc * 16);
            ldsm_x4(av[mi], vs + kv_frag + mi * 16 * LD + kc * 16);
          }
        }
        paired_products_slice<T, MI, BQ, LD>(st, dpt, ak, av, qst, dost, kc, lr, lm);
      }
      // P^T = exp(S^T * scale - lse), zero where masked; dS^T = P^T (dP^T - delta). Only tiles
      // that cross this warp's diagonal or the end of the sequence need the mask.
      const bool need_mask = warp_key0 + WK - 1 > q0 || q0 + BQ > seq || warp_key0 + WK > seq;
      // For the mask, in 32 bits relative to the tile's first query: this lane's first key
      // (floored where it precedes every query of the tile; an active warp's keys end before
      // q0 + BQ + WK), and the first query and key past the sequence.
      const int key_rel = static_cast<int>(max(key_lane - q0, static_cast<int64_t>(-WK)));
      const int query_end = static_cast<int>(min(seq - q0, static_cast<int64_t>(BQ)));
      const int key_end = static_cast<int>(min(seq - q0, static_cast<int64_t>(BQ + WK)));
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        const int key_a = key_rel + 16 * mi, key_b = key_a + 8;
#pragma unroll
        for (int n = 0; n < BQ / 8; ++n) {
          // This lane's two query columns: one 8-byte shared load each for lse and delta.
          const float2 lse2 = *reinterpret_cast<const float2*>(lse_t + n * 8 + 2 * t4);
          const float2 delta2 = *reinterpret_cast<const float2*>(delta_t + n * 8 + 2 * t4);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = n * 8 + 2 * t4 + (e & 1);
            float p = exp2_ftz(fmaf(st[mi][n][e], scale_log2, -((e & 1) ? lse2.y : lse2.x)));
            if (need_mask) {
              const int key = e < 2 ? key_a : key_b;
              if (key > col || col >= query_end || key >= key_end) p = 0.0f;
            }
            st[mi][n][e] = p;
            dpt[mi][n][e] = p * (dpt[mi][n][e] - ((e & 1) ? delta2.y : delta2.x));
          }
        }
      }
      // dV += P^T dO and dK += dS^T Q: the B fragments come from the same row-major dO and Q
      // tiles through ldmatrix.x4.trans, as V does in the forward.
#pragma unroll
      for (int kc = 0; kc < BQ / 16; ++kc) {
        uint32_t ap[MI][4], ads[MI][4];
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
          accumulators_as_a<T>(ap[mi], st[mi][2 * kc], st[mi][2 * kc + 1]);
          accumulators_as_a<T>(ads[mi], dpt[mi][2 * kc], dpt[mi][2 * kc + 1]);
        }
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          uint32_t df[4], qf[4];
          ldsm_x4_trans(df, dost + (kc * 16 + (lm & 1) * 8 + lr) * LD + dp * 16 + (lm >> 1) * 8);
          ldsm_x4_trans(qf, qst + (kc * 16 + (lm & 1) * 8 + lr) * LD + dp * 16 + (lm >> 1) * 8);
          const uint32_t bd0[2] = {df[0], df[1]}, bd1[2] = {df[2], df[3]};
          const uint32_t bq0[2] = {qf[0], qf[1]}, bq1[2] = {qf[2], qf[3]};
#pragma unroll
          for (int mi = 0; mi < MI; ++mi) {
            mma<T>(dv_acc[mi][2 * dp], ap[mi], bd0);
            mma<T>(dv_acc[mi][2 * dp + 1], ap[mi], bd1);
            mma<T>(dk_acc[mi][2 * dp], ads[mi], bq0);
            mma<T>(dk_acc[mi][2 * dp + 1], ads[mi], bq1);
          }
        }
      }
    }  // active

    if constexpr (kFuseDq) {
      // dS^T (zeros for an inactive warp) to shared memory: rows are this warp's keys, columns
      // the tile's queries; rounded to T as the A fragments of dK's product are.
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        uint16_t* ds_a = ds_s + (warp * WK + 16 * mi + g) * Tiles::kDsLd + 2 * t4;
        uint16_t* ds_b = ds_a + 8 * Tiles::kDsLd;
#pragma unroll
        for (int n = 0; n < BQ / 8; ++n) {
          *reinterpret_cast<uint32_t*>(ds_a + n * 8) = pack2<T>(dpt[mi][n][0], dpt[mi][n][1]);
          *reinterpret_cast<uint32_t*>(ds_b + n * 8) = pack2<T>(dpt[mi][n][2], dpt[mi][n][3]);
        }
      }
      __syncthreads();  // every warp's keys of dS^T are staged
      accumulate_dq_tile<T, Tiles>(ds_s, ks, dq_accum + (head0 + i / q_tiles) * seq * D, q0, seq);
    }
  }

#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
    const int64_t key_a = key_lane + 16 * mi, key_b = key_a + 8;
    if (split > 1)  // this part's share, in fp32, for sum_group_parts_kernel to add up in order
      store_dk_dv<T, D>(dk_part + (kv_head * split + part) * seq * D,
                        dv_part + (kv_head * split + part) * seq * D, dk_acc[mi], dv_acc[mi], key_a,
                        key_b, seq, scale);
    else
      store_dk_dv<T, D>(dk + kv_head * seq * D, dv + kv_head * seq * D, dk_acc[mi], dv_acc[mi],
                        key_a, key_b, seq, scale);
  }
}

// dk[h] = T(sum over p of dk_part[h][p]) and the same for dv, p in increasing order, two elements
// a thread: the last pass of a dK/dV kernel whose group of query heads was split over `split`
// blocks. Partials are [kv heads][split][per_head]; per_head (S * D) is even.
template <typename T>
__global__ void sum_group_parts_kernel(const float* dk_part, const float* dv_part, uint16_t* dk,
                                       uint16_t* dv, int64_t kv_heads, int64_t per_head,
                                       int split) {
  const int64_t pairs = kv_heads * per_head / 2;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < pairs;
       i += stride) {
    const int64_t h = 2 * i / per_head, e = 2 * i - h * per_head;
    const int64_t first = h * split * per_head + e;
    float2 k = make_float2(0.0f, 0.0f), v = make_float2(0.0f, 0.0f);
    for (int p = 0; p < split; ++p) {
      const float2 kp = *reinterpret_cast<const float2*>(dk_part + first + p * per_head);
      const float2 vp = *reinterpret_cast<const float2*>(dv_part + first + p * per_head);
      k.x += kp.x;
      k.y += kp.y;
      v.x += vp.x;
      v.y += vp.y;
    }
    *reinterpret_cast<uint32_t*>(dk + 2 * i) = pack2<T>(k.x, k.y);
    *reinterpret_cast<uint32_t*>(dv + 2 * i) = pack2<T>(v.x, v.y);
  }
}

// ---- tensor-core backward: dQ ---------------------------------------------------------------

// A block owns the query rows of 4 warps and walks the key tiles up to the diagonal; K and V
// tiles are double-buffered. D = 64: 16 rows a warp, key tiles of 64. D = 128: 32 rows a warp
// (two m-tiles, so every K and V fragment read from shared memory feeds twice the products),
// key tiles of 32. On an H100 the two m-tiles made the D = 128 backward about 1.5 % faster and
// the D = 64 one about 7 % slower (fewer blocks per SM at 254 registers a thread).
template <int D>
struct DqTiles {
  static constexpr int kMTiles = D <= 64 ? 1 : 2;
  static constexpr int kWarps = 4, kThreads = 32 * kWarps;
  static constexpr int kWarpRows = 16 * kMTiles;
  static constexpr int kRows = kWarpRows * kWarps, kKeys = D <= 64 ? 64 : 32, kLd = D + 8;
  static constexpr int kStage = kKeys * kLd;  // elements of one K or V buffer
  static constexpr size_t kSmem = sizeof(uint16_t) * (2 * kRows * kLd + 4 * kStage);
  // D = 64: the warp's Q and dO fragments (32 registers) stay in registers for the whole key
  // loop, as Q does in the forward, which takes 8 of the 56 ldmatrix of a tile off shared
  // memory. At D = 128 they would take 128.
  static constexpr bool kQdOInRegisters = D <= 64;
  static constexpr int kMinBlocks = D <= 64 ? 3 : 1;
};

template <typename T, int D>
__global__ void __launch_bounds__(DqTiles<D>::kThreads, DqTiles<D>::kMinBlocks)
    flash_backward_dq_kernel(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                             const uint16_t* dout, const float* lse_log2, const float* delta,
                             uint16_t* dq, int heads_q, int group, int64_t seq, float scale_log2,
                             float scale, LaunchOrder order) {
  using Tiles = DqTiles<D>;
  constexpr int BQ = Tiles::kRows, BK = Tiles::kKeys, LD = Tiles::kLd, NT = Tiles::kThreads;
  constexpr int MI = Tiles::kMTiles, WR = Tiles::kWarpRows;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint16_t* qs = reinterpret_cast<uint16_t*>(smem_raw);
  uint16_t* dos = qs + BQ * LD;
  uint16_t* ks = dos + BQ * LD;           // K stages 0 and 1
  uint16_t* vs = ks + 2 * Tiles::kStage;  // V stages 0 and 1

  const auto [tile, head, kv_head] = query_block(order, heads_q, group);
  const uint16_t* kb = k + kv_head * seq * D;
  const uint16_t* vb = v + kv_head * seq * D;
  const int64_t q0 = tile * BQ;
  const int64_t tiles = (min(q0 + BQ, seq) - 1) / BK + 1;

  copy_rows_async<BQ, D, LD, NT>(qs, q + head * seq * D, q0, seq);
  copy_rows_async<BQ, D, LD, NT>(dos, dout + head * seq * D, q0, seq);
  copy_rows_async<BK, D, LD, NT>(ks, kb, 0, seq);
  copy_rows_async<BK, D, LD, NT>(vs, vb, 0, seq);
  cp_async_commit();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const int lr = lane & 7, lm = lane >> 3;  // ldmatrix.x4: row lr of matrix lm
  const int64_t warp_row0 = q0 + warp * WR;
  // Per m-tile and half (rows g and g + 8): lse in the log2 domain and delta.
  float lse_r[MI][2], delta_r[MI][2];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = warp_row0 + 16 * mi + g + 8 * half;
      lse_r[mi][half] = row < seq ? lse_log2[head * seq + row] : INFINITY;
      delta_r[mi][half] = row < seq ? delta[head * seq + row] : 0.0f;
    }
  }
  // Rows of this warp (16 mi + g + 8 half) from row_end on lie past the sequence.
  const int row_end = static_cast<int>(min(seq - warp_row0, static_cast<int64_t>(WR)));
  float dq_acc[MI][D / 8][4];
  zero_tiles(dq_acc);

  // Q and dO fragments for the whole loop when they fit (m-tile 0, columns 16 kc..).
  constexpr int kHeld = Tiles::kQdOInRegisters ? D / 16 : 1;
  uint32_t q_held[kHeld][4], do_held[kHeld][4];
  const int frag_row = warp * WR + (lm & 1) * 8 + lr;  // this lane's ldmatrix row, m-tile 0

  for (int64_t kt = 0; kt < tiles; ++kt) {
    begin_kv_step<BK, D, LD, NT>(ks, vs, Tiles::kStage, kb, vb, kt, tiles, seq);
    if constexpr (Tiles::kQdOInRegisters) {
      if (kt == 0) {
#pragma unroll
        for (int kc = 0; kc < kHeld; ++kc) {
          ldsm_x4(q_held[kc], qs + frag_row * LD + kc * 16 + (lm >> 1) * 8);
          ldsm_x4(do_held[kc], dos + frag_row * LD + kc * 16 + (lm >> 1) * 8);
        }
      }
    }
    const int64_t k0 = kt * BK;
    if (warp_row0 >= seq || k0 > warp_row0 + WR - 1) continue;  // warp-uniform, as in the forward
    const uint16_t* kst = ks + (kt & 1) * Tiles::kStage;
    const uint16_t* vst = vs + (kt & 1) * Tiles::kStage;

    // S = Q K^T and dP = dO V^T: Q and dO rows are A fragments, K and V give B fragments, each
    // read once for every m-tile.
    float s[MI][BK / 8][4], dp[MI][BK / 8][4];
    zero_tiles(s);
    zero_tiles(dp);
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
      uint32_t aq[MI][4], ad[MI][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        if constexpr (Tiles::kQdOInRegisters) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            aq[mi][e] = q_held[kc][e];
            ad[mi][e] = do_held[kc][e];
          }
        } else {
          const int row = frag_row + mi * 16;
          ldsm_x4(aq[mi], qs + row * LD + kc * 16 + (lm >> 1) * 8);
          ldsm_x4(ad[mi], dos + row * LD + kc * 16 + (lm >> 1) * 8);
        }
      }
      paired_products_slice<T, MI, BK, LD>(s, dp, aq, ad, kst, vst, kc, lr, lm);
    }
    // dS = P (dP - delta), P = exp(S * scale - lse), zero where masked (diagonal and last tiles).
    const bool need_mask = k0 + BK - 1 > warp_row0 || k0 + BK > seq || warp_row0 + WR > seq;
    // For the mask, in 32 bits: the warp's first row relative to the tile's first key (capped
    // where no key of the tile can pass it), and the first key past the sequence.
    const int row_rel = static_cast<int>(min(warp_row0 - k0, static_cast<int64_t>(BK)));
    const int key_end = static_cast<int>(min(seq - k0, static_cast<int64_t>(BK)));
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
      for (int n = 0; n < BK / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int half = e >> 1;
          float p = exp2_ftz(fmaf(s[mi][n][e], scale_log2, -lse_r[mi][half]));
          if (need_mask) {
            const int key = n * 8 + 2 * t4 + (e & 1), row = 16 * mi + g + 8 * half;
            if (key > row_rel + row || key >= key_end || row >= row_end) p = 0.0f;
          }
          s[mi][n][e] = p * (dp[mi][n][e] - delta_r[mi][half]);
        }
      }
    }
    // dQ += dS K: dS stays in registers; K is row-major [key][d].
    held_times_rows<T, MI, BK, D, LD>(dq_acc, s, kst, lr, lm);
  }

  uint16_t* dqb = dq + head * seq * D;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = warp_row0 + 16 * mi + g + 8 * half;
      if (row >= seq) continue;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt)
        *reinterpret_cast<uint32_t*>(dqb + row * D + dt * 8 + 2 * t4) =
            pack2<T>(dq_acc[mi][dt][2 * half] * scale, dq_acc[mi][dt][2 * half + 1] * scale);
    }
  }
}

// ---- CUDA-core kernels (any float dtype, D <= 256) ------------------------------------------

constexpr int kSimtMaxD = 256;
constexpr int kPerLane = kSimtMaxD / 32;
constexpr int kSimtWarps = 8;

struct RowIndex {
  int64_t i, head, kv_head;
};

// Query row `row` of the flattened [B, Hq, S] rows.
__device__ __forceinline__ RowIndex query_row(int64_t row, int heads_q, int group, int64_t seq) {
  const int64_t i = row % seq, head = row / seq;
  const int64_t h = head % heads_q, b = head / heads_q;
  return {i, head, b * (heads_q / group) + h / group};
}

template <typename T>
__device__ __forceinline__ void load_lane(const T* p, int D, float (&out)[kPerLane]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    const int d = lane + 32 * e;
    out[e] = d < D ? to_float(p[d]) : 0.0f;
  }
}

template <typename T>
__device__ __forceinline__ float lane_dot(const float (&a)[kPerLane], const T* p, int D) {
  const int lane = threadIdx.x & 31;
  float s = 0.0f;
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    const int d = lane + 32 * e;
    if (d < D) s += a[e] * to_float(p[d]);
  }
  return warp_sum(s);
}

template <typename T>
__device__ __forceinline__ void lane_store(T* p, int D, const float (&a)[kPerLane], float f) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    const int d = lane + 32 * e;
    if (d < D) p[d] = from_float<T>(a[e] * f);
  }
}

template <typename T>
__global__ void simt_forward_kernel(const T* q, const T* k, const T* v, T* out, float* lse,
                                    int64_t rows, int heads_q, int group, int64_t seq, int D,
                                    float scale) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kSimtWarps + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int lane = threadIdx.x & 31;
  const RowIndex r = query_row(row, heads_q, group, seq);
  const T* kb = k + r.kv_head * seq * D;
  const T* vb = v + r.kv_head * seq * D;
  float qv[kPerLane], acc[kPerLane] = {};
  load_lane(q + row * D, D, qv);
  float m = -INFINITY, l = 0.0f;
  for (int64_t j = 0; j <= r.i; ++j) {
    const float s = lane_dot(qv, kb + j * D, D) * scale;
    const float m_new = fmaxf(m, s);
    const float base = m_new == -INFINITY ? 0.0f : m_new;
    const float alpha = expf(m - base), p = expf(s - base);
    l = l * alpha + p;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      const int d = lane + 32 * e;
      acc[e] = acc[e] * alpha + (d < D ? p * to_float(vb[j * D + d]) : 0.0f);
    }
    m = m_new;
  }
  lane_store(out + row * D, D, acc, 1.0f / l);
  if (lane == 0) lse[row] = m + logf(l);
}

template <typename T>
__global__ void simt_backward_dq_kernel(const T* q, const T* k, const T* v, const T* dout,
                                        const float* lse, const float* delta, T* dq, int64_t rows,
                                        int heads_q, int group, int64_t seq, int D, float scale) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kSimtWarps + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int lane = threadIdx.x & 31;
  const RowIndex r = query_row(row, heads_q, group, seq);
  const T* kb = k + r.kv_head * seq * D;
  const T* vb = v + r.kv_head * seq * D;
  float qv[kPerLane], dov[kPerLane], acc[kPerLane] = {};
  load_lane(q + row * D, D, qv);
  load_lane(dout + row * D, D, dov);
  const float L = lse[row], dl = delta[row];
  for (int64_t j = 0; j <= r.i; ++j) {
    const float p = expf(lane_dot(qv, kb + j * D, D) * scale - L);
    const float ds = p * (lane_dot(dov, vb + j * D, D) - dl);
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      const int d = lane + 32 * e;
      if (d < D) acc[e] += ds * to_float(kb[j * D + d]);
    }
  }
  lane_store(dq + row * D, D, acc, scale);
}

// One warp per key row of a kv head; loops over the group's query heads and the queries that
// see the key, in a fixed order.
template <typename T>
__global__ void simt_backward_dkdv_kernel(const T* q, const T* k, const T* v, const T* dout,
                                          const float* lse, const float* delta, T* dk, T* dv,
                                          int64_t kv_rows, int heads_q, int group, int64_t seq,
                                          int D, float scale) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kSimtWarps + (threadIdx.x >> 5);
  if (row >= kv_rows) return;
  const int lane = threadIdx.x & 31;
  const int heads_kv = heads_q / group;
  const int64_t j = row % seq, kv_head = row / seq;
  const int64_t hk = kv_head % heads_kv, b = kv_head / heads_kv;
  float kv[kPerLane], vv[kPerLane], dk_acc[kPerLane] = {}, dv_acc[kPerLane] = {};
  load_lane(k + row * D, D, kv);
  load_lane(v + row * D, D, vv);
  for (int hh = 0; hh < group; ++hh) {
    const int64_t head = b * heads_q + hk * group + hh;
    for (int64_t i = j; i < seq; ++i) {
      const int64_t qrow = head * seq + i;
      const T* qi = q + qrow * D;
      const T* doi = dout + qrow * D;
      const float p = expf(lane_dot(kv, qi, D) * scale - lse[qrow]);
      const float ds = p * (lane_dot(vv, doi, D) - delta[qrow]);
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        const int d = lane + 32 * e;
        if (d < D) {
          dv_acc[e] += p * to_float(doi[d]);
          dk_acc[e] += ds * to_float(qi[d]);
        }
      }
    }
  }
  lane_store(dk + row * D, D, dk_acc, scale);
  lane_store(dv + row * D, D, dv_acc, 1.0f);
}

// delta[row] = sum_d dout[row, d] * out[row, d], and lse_log2[row] = lse[row] * log2(e) when
// lse_log2 is given (the tensor-core kernels work in the log2 domain).
template <typename T>
__global__ void delta_kernel(const T* out, const T* dout, const float* lse, float* delta,
                             float* lse_log2, int64_t rows, int D) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kSimtWarps + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int lane = threadIdx.x & 31;
  float s = 0.0f;
  for (int d = lane; d < D; d += 32) s += to_float(out[row * D + d]) * to_float(dout[row * D + d]);
  s = warp_sum(s);
  if (lane == 0) {
    delta[row] = s;
    if (lse_log2 != nullptr) lse_log2[row] = lse[row] * kLog2e;
  }
}

// ---- launching ------------------------------------------------------------------------------

template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  // Above 48 KiB a kernel must opt in; the attribute is per device, so set it on every launch
  // (a cheap call) rather than tracking devices.
  ST_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(bytes)));
}

// The most any of a head dim's tensor-core kernels asks for: the forward, the dQ pass, and the
// dK/dV pass with the one-pass dQ (its larger form) at one or two m-tiles.
template <int D>
constexpr size_t tc_kernels_smem() {
  size_t most = std::max(FwdTiles<D>::kSmem, DqTiles<D>::kSmem);
  most = std::max(most, DkDvTiles<D, 1>::kSmemFusedDq);
  if constexpr (D <= 64) most = std::max(most, DkDvTiles<D, 2>::kSmemFusedDq);
  return most;
}

bool tensor_core_path(DType type, int64_t head_dim, std::initializer_list<const void*> ptrs) {
  // A device whose blocks cannot take the tiles (compute capability 8.6 / 8.9 at head dim 128)
  // runs the CUDA-core kernels; the trainer says so at start.
  if (!cuda::attention_uses_tensor_cores(-1, type, head_dim)) return false;
  for (const void* p : ptrs)
    if (!aligned(p, 16)) return false;
  return true;
}

// The longest-first order of `ranks` blocks for each of `units` units, each unit reading about
// `unit_bytes` that its blocks share (see launch_order.h). Chunks hold the units whose shared
// inputs take kL2Share, about half the L2 of an A100 (40 MB) or H100 (50 MB), but never fewer
// blocks than kMinWaves times the GPU's slots (two blocks an SM): a chunk that the GPU runs
// whole at once has no order to speak of, and the list-scheduling model in launch_order.h gave
// back most of the gain of longest-first at smaller chunks (the chunk boundaries become tails).
// Blocks the GPU runs at once, counting two to an SM (the attention kernels' usual occupancy).
int64_t block_slots() {
  return 2 * static_cast<int64_t>(cuda::multiprocessor_count(-1));
}

LaunchOrder longest_first(int64_t ranks, int64_t units, int64_t unit_bytes) {
  constexpr int64_t kL2Share = int64_t{20} << 20;
  constexpr int64_t kMinWaves = 4;
  ST_CHECK(ranks * units <= 0x7fffffff, "attention: ", ranks * units,
           " blocks are more than one kernel launch takes");
  const int64_t slots = block_slots();
  const int64_t by_l2 = kL2Share / std::max<int64_t>(unit_bytes, 1);
  const int64_t by_waves = (kMinWaves * slots + ranks - 1) / ranks;
  const int64_t chunk = std::clamp<int64_t>(std::max(by_l2, by_waves), 1, units);
  return {static_cast<uint32_t>(ranks), static_cast<uint32_t>(units), static_cast<uint32_t>(chunk)};
}

// The longest-first order of a forward or dQ kernel with `rows` query rows a block: a query head's
// blocks share its kv head's K and V with the rest of the group.
LaunchOrder query_tile_order(const AttentionDims& d, int64_t rows) {
  return longest_first(ceil_div(d.seq, rows), d.batch * d.heads_q,
                       d.seq * d.head_dim * 2 * 2 / (d.heads_q / d.heads_kv));
}

template <typename T, int D>
void tc_forward(const AttentionDims& d, const void* q, const void* k, const void* v, void* out,
                float* lse, cudaStream_t stream) {
  using Tiles = FwdTiles<D>;
  auto kernel = flash_forward_kernel<T, D>;
  allow_smem(kernel, Tiles::kSmem);
  const LaunchOrder order = query_tile_order(d, Tiles::kRows);
  kernel<<<order.blocks(), Tiles::kThreads, Tiles::kSmem, stream>>>(
      static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(k),
      static_cast<const uint16_t*>(v), static_cast<uint16_t*>(out), lse,
      static_cast<int>(d.heads_q), static_cast<int>(d.heads_q / d.heads_kv), d.seq,
      d.scale * kLog2e, order);
  ST_CHECK_LAUNCH();
}

// dq = T(accum * scale), two elements a thread: the one-pass backward's last step. n is even
// (a multiple of the head dim).
template <typename T>
__global__ void finish_dq_kernel(const float* accum, uint16_t* dq, int64_t n, float scale) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n / 2;
       i += stride)
    *reinterpret_cast<uint32_t*>(dq + 2 * i) =
        pack2<T>(accum[2 * i] * scale, accum[2 * i + 1] * scale);
}

// How many blocks share one kv head's group of query heads in the dK/dV kernel (a divisor of the
// group). A block walks its query heads one after another, and the blocks of the first keys,
// which every query sees, walk the most query tiles. The grid starts those first (longest-first
// order), but when one of them alone takes longer than the average slot's share of all the work,
// it sets the kernel's time: at B=1, Hq=32, Hkv=8, S=2048, D=64, 128 blocks of 128 keys for an
// H100's 264 slots, the first of them 4 x 64 steps long against 66 per slot. Splitting the group
// gives more and shorter blocks, for the price of fp32 partials and a pass that adds them (in a
// fixed order: still deterministic). Automatic (requested 0): the smallest split whose longest
// block is no longer than a slot's share, with two blocks of the kernel to an SM;
// `requested` > 0 forces one (tests).
int group_split(const AttentionDims& d, int64_t key_blocks, int64_t block_keys, int64_t tile_rows,
                int requested) {
  const int group = static_cast<int>(d.heads_q / d.heads_kv);
  if (requested > 0) {
    ST_CHECK(group % requested == 0, "attention backward: ", requested, " parts of a group of ",
             group, " query heads");
    return requested;
  }
  // Steps (query tiles) of one query head in the first key block, and in all of them.
  const int64_t q_tiles = (d.seq + tile_rows - 1) / tile_rows;
  int64_t head_steps = 0;
  for (int64_t kb = 0; kb < key_blocks; ++kb) head_steps += q_tiles - kb * block_keys / tile_rows;
  const int64_t slot_share = d.batch * d.heads_q * head_steps / block_slots();
  for (int s = 1; s < group; ++s)
    if (group % s == 0 && (group / s) * q_tiles <= slot_share) return s;
  return group;
}

// The dK/dV kernel with MI key m-tiles a warp (and dQ's fp32 sums into dq_accum when that is
// given), then the pass that adds the group parts' partials when the group was split.
template <typename T, int D, int MI>
void dkdv_pass(const AttentionDims& d, const uint16_t* q, const uint16_t* k, const uint16_t* v,
               const uint16_t* dout, const float* lse_log2, const float* delta, void* dk, void* dv,
               float* dq_accum, int requested_split, Scratch& scratch, cudaStream_t stream) {
  using Tiles = DkDvTiles<D, MI>;
  const int group = static_cast<int>(d.heads_q / d.heads_kv);
  const int64_t key_blocks = ceil_div(d.seq, Tiles::kKeys);
  const int split = group_split(d, key_blocks, Tiles::kKeys, Tiles::kRows, requested_split);
  const int64_t per_head = d.seq * D;
  float *dk_part = nullptr, *dv_part = nullptr;
  if (split > 1) {
    const size_t bytes =
        sizeof(float) * static_cast<size_t>(d.batch * d.heads_kv * split * per_head);
    dk_part = static_cast<float*>(scratch.get(bytes));
    dv_part = static_cast<float*>(scratch.get(bytes));
  }
  const bool fuse_dq = dq_accum != nullptr;
  auto kernel = fuse_dq ? flash_backward_dkdv_kernel<T, D, MI, true>
                        : flash_backward_dkdv_kernel<T, D, MI, false>;
  const size_t smem = fuse_dq ? Tiles::kSmemFusedDq : Tiles::kSmem;
  allow_smem(kernel, smem);
  // A unit's blocks share the Q and dO of its group / split query heads.
  const LaunchOrder order =
      longest_first(key_blocks, d.batch * d.heads_kv * split, per_head * 2 * 2 * (group / split));
  kernel<<<order.blocks(), Tiles::kThreads, smem, stream>>>(
      q, k, v, dout, lse_log2, delta, static_cast<uint16_t*>(dk), static_cast<uint16_t*>(dv),
      dk_part, dv_part, dq_accum, static_cast<int>(d.heads_q), group, split, d.seq,
      d.scale * kLog2e, d.scale, order);
  ST_CHECK_LAUNCH();
  if (split > 1) {
    sum_group_parts_kernel<T>
        <<<grid_for(d.batch * d.heads_kv * per_head / 2), kThreads, 0, stream>>>(
            dk_part, dv_part, static_cast<uint16_t*>(dk), static_cast<uint16_t*>(dv),
            d.batch * d.heads_kv, per_head, split);
    ST_CHECK_LAUNCH();
  }
}

// The tensor-core backward: dK/dV (one pass, with dQ too under AtomicDq, whose fp32 sums are
// then scaled and rounded), or dK/dV and then the dQ pass. lse_log2 is lse * log2(e).
template <typename T, int D>
void tc_backward(const AttentionDims& d, const void* q, const void* k, const void* v,
                 const void* dout, const float* lse_log2, const float* delta, void* dq, void* dk,
                 void* dv, const AttentionBackwardOptions& options, Scratch& scratch,
                 cudaStream_t stream) {
  const auto* q16 = static_cast<const uint16_t*>(q);
  const auto* k16 = static_cast<const uint16_t*>(k);
  const auto* v16 = static_cast<const uint16_t*>(v);
  const auto* do16 = static_cast<const uint16_t*>(dout);
  const bool fuse_dq = options.algo == AttentionBackwardAlgo::AtomicDq;
  const int64_t dq_elements = d.batch * d.heads_q * d.seq * D;
  float* dq_accum = nullptr;
  if (fuse_dq) {
    dq_accum = static_cast<float*>(scratch.get(sizeof(float) * static_cast<size_t>(dq_elements)));
    ST_CUDA_CHECK(
        cudaMemsetAsync(dq_accum, 0, sizeof(float) * static_cast<size_t>(dq_elements), stream));
  }
  const int m_tiles =
      options.dkdv_m_tiles > 0 ? options.dkdv_m_tiles : default_dkdv_m_tiles(d.head_dim);
  ST_CHECK(m_tiles == 1 || (m_tiles == 2 && D <= 64), "attention backward: ", m_tiles,
           " key m-tiles a warp at head dim ", D, " (1, or 2 at head dim 64)");
  // The m-tiles as a compile-time constant. Two exist only at D <= 64; above it the check just
  // made leaves the first branch unreachable, and it names the one-m-tile kernel.
  auto run_dkdv = [&](auto m_tiles_c) {
    dkdv_pass<T, D, decltype(m_tiles_c)::value>(d, q16, k16, v16, do16, lse_log2, delta, dk, dv,
                                                dq_accum, options.group_split, scratch, stream);
  };
  if (m_tiles == 2)
    run_dkdv(std::integral_constant < int, D <= 64 ? 2 : 1 > {});
  else
    run_dkdv(std::integral_constant<int, 1>{});
  if (fuse_dq) {
    finish_dq_kernel<T><<<grid_for(dq_elements / 2), kThreads, 0, stream>>>(
        dq_accum, static_cast<uint16_t*>(dq), dq_elements, d.scale);
    ST_CHECK_LAUNCH();
    return;
  }
  using Tiles = DqTiles<D>;
  auto kernel = flash_backward_dq_kernel<T, D>;
  allow_smem(kernel, Tiles::kSmem);
  const LaunchOrder order = query_tile_order(d, Tiles::kRows);
  kernel<<<order.blocks(), Tiles::kThreads, Tiles::kSmem, stream>>>(
      q16, k16, v16, do16, lse_log2, delta, static_cast<uint16_t*>(dq), static_cast<int>(d.heads_q),
      static_cast<int>(d.heads_q / d.heads_kv), d.seq, d.scale * kLog2e, d.scale, order);
  ST_CHECK_LAUNCH();
}

#define ST_DISPATCH_HEAD_DIM(head_dim, D, ...) \
  if (head_dim == 64) {                        \
    constexpr int D = 64;                      \
    __VA_ARGS__;                               \
  } else {                                     \
    constexpr int D = 128;                     \
    __VA_ARGS__;                               \
  }

void check_dims(const AttentionDims& d) {
  ST_CHECK_SHAPE(d.head_dim <= kSimtMaxD, "attention head dim ", d.head_dim, " is larger than the ",
                 kSimtMaxD, " the CUDA kernels support");
  ST_CHECK_SHAPE(d.heads_kv > 0 && d.heads_q % d.heads_kv == 0, "attention: ", d.heads_q,
                 " query heads are not a multiple of ", d.heads_kv, " key/value heads");
  // Every grid is one-dimensional, so batch and heads meet no grid limit of their own; the
  // kernels take the head count as a 32-bit int, and the block counts are checked at launch.
  ST_CHECK_SHAPE(d.heads_q <= INT32_MAX, "attention: ", d.heads_q,
                 " query heads are more than the kernels index (2^31 - 1)");
  ST_CHECK_SHAPE(ceil_div(d.batch * d.heads_q * d.seq, kSimtWarps) <= INT32_MAX,
                 "attention: ", d.batch, " x ", d.heads_q, " x ", d.seq,
                 " query rows are more than one kernel launch takes; split the batch");
}

}  // namespace

size_t attention_tensor_core_smem(int64_t head_dim) {
  if (head_dim == 64) return tc_kernels_smem<64>();
  if (head_dim == 128) return tc_kernels_smem<128>();
  return 0;
}

void attention_forward(const AttentionDims& d, const void* q, const void* k, const void* v,
                       DType type, void* out, float* lse, cudaStream_t stream) {
  const int64_t rows = d.batch * d.heads_q * d.seq;
  if (rows == 0) return;
  check_dims(d);
  if (tensor_core_path(type, d.head_dim, {q, k, v, out})) {
    if (type == DType::BF16) {
      ST_DISPATCH_HEAD_DIM(d.head_dim, D, tc_forward<bf16, D>(d, q, k, v, out, lse, stream));
    } else {
      ST_DISPATCH_HEAD_DIM(d.head_dim, D, tc_forward<f16, D>(d, q, k, v, out, lse, stream));
    }
    return;
  }
  ST_DISPATCH_FLOAT(type, T, {
    simt_forward_kernel<T><<<ceil_div(rows, kSimtWarps), 32 * kSimtWarps, 0, stream>>>(
        static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
        static_cast<T*>(out), lse, rows, static_cast<int>(d.heads_q),
        static_cast<int>(d.heads_q / d.heads_kv), d.seq, static_cast<int>(d.head_dim), d.scale);
    ST_CHECK_LAUNCH();
  });
}

void attention_backward(const AttentionDims& d, const void* q, const void* k, const void* v,
                        const void* out, const float* lse, const void* dout, DType type, void* dq,
                        void* dk, void* dv, const AttentionBackwardOptions& options,
                        Scratch& scratch, cudaStream_t stream) {
  const int64_t rows = d.batch * d.heads_q * d.seq;
  if (rows == 0) return;
  check_dims(d);
  float* delta = static_cast<float*>(scratch.get(sizeof(float) * rows));
  const int heads_q = static_cast<int>(d.heads_q);
  const int group = static_cast<int>(d.heads_q / d.heads_kv);
  const int D = static_cast<int>(d.head_dim);
  const bool tensor_cores = tensor_core_path(type, d.head_dim, {q, k, v, dout, dq, dk, dv});
  float* lse_log2 = tensor_cores ? static_cast<float*>(scratch.get(sizeof(float) * rows)) : nullptr;
  ST_DISPATCH_FLOAT(type, T, {
    delta_kernel<T><<<ceil_div(rows, kSimtWarps), 32 * kSimtWarps, 0, stream>>>(
        static_cast<const T*>(out), static_cast<const T*>(dout), lse, delta, lse_log2, rows, D);
    ST_CHECK_LAUNCH();
  });
  if (tensor_cores) {
    if (type == DType::BF16) {
      ST_DISPATCH_HEAD_DIM(d.head_dim, HD,
                           tc_backward<bf16, HD>(d, q, k, v, dout, lse_log2, delta, dq, dk, dv,
                                                 options, scratch, stream));
    } else {
      ST_DISPATCH_HEAD_DIM(d.head_dim, HD,
                           tc_backward<f16, HD>(d, q, k, v, dout, lse_log2, delta, dq, dk, dv,
                                                options, scratch, stream));
    }
    return;
  }
  // The CUDA-core kernels have one backward, deterministic, whatever `options` ask.
  const int64_t kv_rows = d.batch * d.heads_kv * d.seq;
  ST_DISPATCH_FLOAT(type, T, {
    const T* qt = static_cast<const T*>(q);
    const T* kt = static_cast<const T*>(k);
    const T* vt = static_cast<const T*>(v);
    const T* dot = static_cast<const T*>(dout);
    simt_backward_dq_kernel<T><<<ceil_div(rows, kSimtWarps), 32 * kSimtWarps, 0, stream>>>(
        qt, kt, vt, dot, lse, delta, static_cast<T*>(dq), rows, heads_q, group, d.seq, D, d.scale);
    ST_CHECK_LAUNCH();
    simt_backward_dkdv_kernel<T><<<ceil_div(kv_rows, kSimtWarps), 32 * kSimtWarps, 0, stream>>>(
        qt, kt, vt, dot, lse, delta, static_cast<T*>(dk), static_cast<T*>(dv), kv_rows, heads_q,
        group, d.seq, D, d.scale);
    ST_CHECK_LAUNCH();
  });
}

}  // namespace shardtrain::kernels
