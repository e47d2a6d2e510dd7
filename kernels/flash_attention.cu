// Fused causal attention (flash-attention algorithm) with grouped-query heads.
//
// Forward: a block owns 64 query rows of one head (4 warps x 16 rows) and walks the key/value
// tiles of 64 keys up to the diagonal. Scores S = Q K^T and the product P V run on tensor cores
// (mma.sync m16n8k16, bf16/f16 inputs, fp32 accumulation); the softmax is online (running row
// max and sum in fp32 registers), so memory is O(S) and the S x S matrix never exists. The
// log-sum-exp of every row is saved for the backward pass.
//
// Backward (FlashAttention-2 style, deterministic: no atomics):
//   delta_i = sum_d dO_i * O_i                        (one warp per row)
//   dK, dV: a block owns 64 keys of one kv head and loops over the query heads of its group and
//           the query tiles at or after its keys, recomputing P = exp(S - lse) and
//           dS = P * (dO V^T - delta); dV += P^T dO, dK += dS^T Q.
//   dQ:     a block owns 64 query rows and loops over key tiles up to the diagonal;
//           dQ += dS K.
// dQ is recomputed in its own pass instead of being accumulated with atomics across key blocks,
// which costs two extra matrix products per tile and makes every result bit-reproducible.
//
// Tensor-core fragments follow the PTX ISA layouts for mma.m16n8k16 (groupID = lane / 4,
// tig = lane % 4): A rows groupID and groupID + 8, columns 2 tig + {0, 1} (+ 8); B columns
// groupID, rows 2 tig + {0, 1} (+ 8); C rows groupID / groupID + 8, columns 2 tig + {0, 1}.
// Operands are staged in shared memory so that every fragment is a 32-bit load; a matrix used
// as the k-major B operand is stored transposed. Rows are padded by 8 elements, which makes the
// fragment loads of a warp hit 32 distinct banks.
//
// Other cases (f32, head dims other than 64 and 128, misaligned pointers) run on CUDA-core
// kernels with one warp per row: exact fp32, deterministic, but much slower.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "common.cuh"

namespace shardtrain::kernels {

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kWarps = 4;
constexpr int kBlockThreads = 32 * kWarps;

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
#else
  __trap();  // the host code never launches these kernels below sm_80
#endif
}

__device__ __forceinline__ uint32_t ld32(const uint16_t* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// A fragment of the 16x16 tile at (row0, col0) of a row-major shared matrix.
__device__ __forceinline__ void load_a(const uint16_t* s, int ld, int row0, int col0,
                                       uint32_t (&a)[4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const uint16_t* p = s + (row0 + g) * ld + col0 + 2 * t;
  a[0] = ld32(p);
  a[1] = ld32(p + 8 * ld);
  a[2] = ld32(p + 8);
  a[3] = ld32(p + 8 * ld + 8);
}

// B fragment of the k x n = 16x8 tile whose transpose starts at (n0, k0) of a row-major shared
// matrix (that is, the matrix stores B^T: element (k, n) of B at s[n * ld + k]).
__device__ __forceinline__ void load_b(const uint16_t* s, int ld, int n0, int k0,
                                       uint32_t (&b)[2]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const uint16_t* p = s + (n0 + g) * ld + k0 + 2 * t;
  b[0] = ld32(p);
  b[1] = ld32(p + 8);
}

// Rows [row0, row0 + ROWS) of a [seq, D] matrix into shared [ROWS][LD]; rows past seq are zero.
template <int ROWS, int D, int LD>
__device__ __forceinline__ void load_rows(uint16_t* dst, const uint16_t* src, int64_t row0,
                                          int64_t seq) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  for (int idx = threadIdx.x; idx < ROWS * kChunks; idx += kBlockThreads) {
    const int r = idx / kChunks, c = (idx % kChunks) * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (row0 + r < seq) v = *reinterpret_cast<const uint4*>(src + (row0 + r) * D + c);
    *reinterpret_cast<uint4*>(dst + r * LD + c) = v;
  }
}

// The same rows stored transposed: dst[d * LDT + r]. Consecutive threads take consecutive rows
// so that the 16-bit shared stores of a warp spread over the banks.
template <int ROWS, int D, int LDT>
__device__ __forceinline__ void load_rows_transposed(uint16_t* dst, const uint16_t* src,
                                                     int64_t row0, int64_t seq) {
  constexpr int kChunks = D / 8;
  for (int idx = threadIdx.x; idx < ROWS * kChunks; idx += kBlockThreads) {
    const int r = idx % ROWS, c = (idx / ROWS) * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (row0 + r < seq) v = *reinterpret_cast<const uint4*>(src + (row0 + r) * D + c);
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 8; ++j)
      dst[(c + j) * LDT + r] = static_cast<uint16_t>(words[j / 2] >> (16 * (j % 2)));
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

// ---- tensor-core forward --------------------------------------------------------------------

template <int D>
struct FwdTiles {
  static constexpr int kRows = 64, kKeys = 64, kLd = D + 8, kLdT = kKeys + 8;
  static constexpr size_t kSmem = sizeof(uint16_t) * (kRows * kLd + kKeys * kLd + D * kLdT);
};

template <typename T, int D>
__global__ void __launch_bounds__(kBlockThreads)
    flash_forward_kernel(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out,
                         float* lse, int heads_q, int group, int64_t seq, float scale_log2) {
  using Tiles = FwdTiles<D>;
  constexpr int BR = Tiles::kRows, BC = Tiles::kKeys, LD = Tiles::kLd, LDT = Tiles::kLdT;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint16_t* qs = reinterpret_cast<uint16_t*>(smem_raw);
  uint16_t* ks = qs + BR * LD;
  uint16_t* vt = ks + BC * LD;

  const int64_t tile = gridDim.x - 1 - blockIdx.x;  // the longest rows start first
  const int h = blockIdx.y, b = blockIdx.z;
  const int heads_kv = heads_q / group;
  const int64_t head = static_cast<int64_t>(b) * heads_q + h;
  const int64_t kv_head = static_cast<int64_t>(b) * heads_kv + h / group;
  const uint16_t* qb = q + head * seq * D;
  const uint16_t* kb = k + kv_head * seq * D;
  const uint16_t* vb = v + kv_head * seq * D;
  const int64_t q0 = tile * BR;

  load_rows<BR, D, LD>(qs, qb, q0, seq);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const int64_t row_a = q0 + warp * 16 + g, row_b = row_a + 8;
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.0f, l_b = 0.0f;
  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;

  const int64_t last_row = min(q0 + BR, seq) - 1;
  const int64_t tiles = last_row / BC + 1;
  for (int64_t kt = 0; kt < tiles; ++kt) {
    const int64_t k0 = kt * BC;
    __syncthreads();  // the previous tile has been consumed (and Q is in place)
    load_rows<BC, D, LD>(ks, kb, k0, seq);
    load_rows_transposed<BC, D, LDT>(vt, vb, k0, seq);
    __syncthreads();

    float s[BC / 8][4];
#pragma unroll
    for (int i = 0; i < BC / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
      uint32_t a[4];
      load_a(qs, LD, warp * 16, kc * 16, a);
#pragma unroll
      for (int nt = 0; nt < BC / 8; ++nt) {
        uint32_t bb[2];
        load_b(ks, LD, nt * 8, kc * 16, bb);
        mma<T>(s[nt], a, bb);
      }
    }

    // Scale into the log2 domain and mask keys after the query (and past the sequence).
    float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < BC / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t key = k0 + nt * 8 + 2 * t4 + (e & 1);
        const int64_t row = e < 2 ? row_a : row_b;
        float x = s[nt][e] * scale_log2;
        if (key > row || key >= seq) x = -INFINITY;
        s[nt][e] = x;
        if (e < 2)
          mx_a = fmaxf(mx_a, x);
        else
          mx_b = fmaxf(mx_b, x);
      }
    }
    mx_a = quad_max(mx_a);
    mx_b = quad_max(mx_b);
    const float new_a = fmaxf(m_a, mx_a), new_b = fmaxf(m_b, mx_b);
    // Key 0 is visible to every row, so the max is finite after the first tile; the guard keeps
    // exp2(-inf - -inf) out regardless.
    const float base_a = new_a == -INFINITY ? 0.0f : new_a;
    const float base_b = new_b == -INFINITY ? 0.0f : new_b;
    const float alpha_a = exp2f(m_a - base_a), alpha_b = exp2f(m_b - base_b);
    m_a = new_a;
    m_b = new_b;
    float sum_a = 0.0f, sum_b = 0.0f;
#pragma unroll
    for (int nt = 0; nt < BC / 8; ++nt) {
      s[nt][0] = exp2f(s[nt][0] - base_a);
      s[nt][1] = exp2f(s[nt][1] - base_a);
      s[nt][2] = exp2f(s[nt][2] - base_b);
      s[nt][3] = exp2f(s[nt][3] - base_b);
      sum_a += s[nt][0] + s[nt][1];
      sum_b += s[nt][2] + s[nt][3];
    }
    // Per-lane partial row sums: alpha is the same for the four lanes of a row, so the partials
    // are combined once at the end.
    l_a = l_a * alpha_a + sum_a;
    l_b = l_b * alpha_b + sum_b;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      o[dt][0] *= alpha_a;
      o[dt][1] *= alpha_a;
      o[dt][2] *= alpha_b;
      o[dt][3] *= alpha_b;
    }

    // O += P V: the score accumulators of two adjacent 8-key tiles form one A fragment.
#pragma unroll
    for (int kc = 0; kc < BC / 16; ++kc) {
      const uint32_t a[4] = {pack2<T>(s[2 * kc][0], s[2 * kc][1]),
                             pack2<T>(s[2 * kc][2], s[2 * kc][3]),
                             pack2<T>(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                             pack2<T>(s[2 * kc + 1][2], s[2 * kc + 1][3])};
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        uint32_t bb[2];
        load_b(vt, LDT, dt * 8, kc * 16, bb);
        mma<T>(o[dt], a, bb);
      }
    }
  }

  l_a = quad_sum(l_a);
  l_b = quad_sum(l_b);
  uint16_t* ob = out + head * seq * D;
  float* lb = lse + head * seq;
  if (row_a < seq) {
    const float inv = 1.0f / l_a;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
      *reinterpret_cast<uint32_t*>(ob + row_a * D + dt * 8 + 2 * t4) =
          pack2<T>(o[dt][0] * inv, o[dt][1] * inv);
    if (t4 == 0) lb[row_a] = (m_a + log2f(l_a)) * kLn2;
  }
  if (row_b < seq) {
    const float inv = 1.0f / l_b;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
      *reinterpret_cast<uint32_t*>(ob + row_b * D + dt * 8 + 2 * t4) =
          pack2<T>(o[dt][2] * inv, o[dt][3] * inv);
    if (t4 == 0) lb[row_b] = (m_b + log2f(l_b)) * kLn2;
  }
}

// ---- tensor-core backward: dK and dV --------------------------------------------------------

template <int D>
struct DkDvTiles {
  static constexpr int kKeys = 64, kRows = 32, kLd = D + 8, kLdT = kRows + 8;
  static constexpr size_t kHalfWords = 2 * kKeys * kLd + 2 * kRows * kLd + 2 * D * kLdT;
  static constexpr size_t kSmem = sizeof(uint16_t) * kHalfWords + sizeof(float) * 2 * kRows;
};

template <typename T, int D>
__global__ void __launch_bounds__(kBlockThreads)
    flash_backward_dkdv_kernel(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                               const uint16_t* dout, const float* lse, const float* delta,
                               uint16_t* dk, uint16_t* dv, int heads_q, int group, int64_t seq,
                               float scale_log2, float scale) {
  using Tiles = DkDvTiles<D>;
  constexpr int BK = Tiles::kKeys, BQ = Tiles::kRows, LD = Tiles::kLd, LDT = Tiles::kLdT;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint16_t* ks = reinterpret_cast<uint16_t*>(smem_raw);
  uint16_t* vs = ks + BK * LD;
  uint16_t* qs = vs + BK * LD;
  uint16_t* dos = qs + BQ * LD;
  uint16_t* qt = dos + BQ * LD;
  uint16_t* dot = qt + D * LDT;
  float* lse_s = reinterpret_cast<float*>(smem_raw + sizeof(uint16_t) * Tiles::kHalfWords);
  float* delta_s = lse_s + BQ;

  const int64_t k0 = static_cast<int64_t>(blockIdx.x) * BK;
  const int hk = blockIdx.y, b = blockIdx.z;
  const int heads_kv = heads_q / group;
  const int64_t kv_head = static_cast<int64_t>(b) * heads_kv + hk;
  load_rows<BK, D, LD>(ks, k + kv_head * seq * D, k0, seq);
  load_rows<BK, D, LD>(vs, v + kv_head * seq * D, k0, seq);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const int64_t key_a = k0 + warp * 16 + g, key_b = key_a + 8;
  float dk_acc[D / 8][4], dv_acc[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk_acc[i][e] = dv_acc[i][e] = 0.0f;

  const int64_t first_tile = k0 / BQ;  // earlier queries cannot see these keys
  const int64_t q_tiles = (seq + BQ - 1) / BQ;
  for (int hh = 0; hh < group; ++hh) {
    const int64_t head = static_cast<int64_t>(b) * heads_q + hk * group + hh;
    const uint16_t* qb = q + head * seq * D;
    const uint16_t* dob = dout + head * seq * D;
    const float* lb = lse + head * seq;
    const float* db = delta + head * seq;
    for (int64_t qt_i = first_tile; qt_i < q_tiles; ++qt_i) {
      const int64_t q0 = qt_i * BQ;
      __syncthreads();  // the previous query tile has been consumed
      load_rows<BQ, D, LD>(qs, qb, q0, seq);
      load_rows<BQ, D, LD>(dos, dob, q0, seq);
      load_rows_transposed<BQ, D, LDT>(qt, qb, q0, seq);
      load_rows_transposed<BQ, D, LDT>(dot, dob, q0, seq);
      if (threadIdx.x < BQ) {
        const int64_t r = q0 + threadIdx.x;
        lse_s[threadIdx.x] = r < seq ? lb[r] * kLog2e : INFINITY;
        delta_s[threadIdx.x] = r < seq ? db[r] : 0.0f;
      }
      __syncthreads();

      // S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys x 32 queries.
      float st[BQ / 8][4], dpt[BQ / 8][4];
#pragma unroll
      for (int i = 0; i < BQ / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) st[i][e] = dpt[i][e] = 0.0f;
#pragma unroll
      for (int kc = 0; kc < D / 16; ++kc) {
        uint32_t ak[4], av[4];
        load_a(ks, LD, warp * 16, kc * 16, ak);
        load_a(vs, LD, warp * 16, kc * 16, av);
#pragma unroll
        for (int nt = 0; nt < BQ / 8; ++nt) {
          uint32_t bq[2], bd[2];
          load_b(qs, LD, nt * 8, kc * 16, bq);
          load_b(dos, LD, nt * 8, kc * 16, bd);
          mma<T>(st[nt], ak, bq);
          mma<T>(dpt[nt], av, bd);
        }
      }
      // P^T = exp(S^T * scale - lse) (0 where masked); dS^T = P^T (dP^T - delta).
#pragma unroll
      for (int nt = 0; nt < BQ / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = nt * 8 + 2 * t4 + (e & 1);
          const int64_t query = q0 + col;
          const int64_t key = e < 2 ? key_a : key_b;
          float p = exp2f(st[nt][e] * scale_log2 - lse_s[col]);
          if (key > query || query >= seq || key >= seq) p = 0.0f;
          st[nt][e] = p;
          dpt[nt][e] = p * (dpt[nt][e] - delta_s[col]);
        }
      }
      // dV += P^T dO and dK += dS^T Q (B operands from the transposed copies).
#pragma unroll
      for (int kc = 0; kc < BQ / 16; ++kc) {
        const uint32_t ap[4] = {pack2<T>(st[2 * kc][0], st[2 * kc][1]),
                                pack2<T>(st[2 * kc][2], st[2 * kc][3]),
                                pack2<T>(st[2 * kc + 1][0], st[2 * kc + 1][1]),
                                pack2<T>(st[2 * kc + 1][2], st[2 * kc + 1][3])};
        const uint32_t ads[4] = {pack2<T>(dpt[2 * kc][0], dpt[2 * kc][1]),
                                 pack2<T>(dpt[2 * kc][2], dpt[2 * kc][3]),
                                 pack2<T>(dpt[2 * kc + 1][0], dpt[2 * kc + 1][1]),
                                 pack2<T>(dpt[2 * kc + 1][2], dpt[2 * kc + 1][3])};
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
          uint32_t bd[2], bq[2];
          load_b(dot, LDT, dt * 8, kc * 16, bd);
          load_b(qt, LDT, dt * 8, kc * 16, bq);
          mma<T>(dv_acc[dt], ap, bd);
          mma<T>(dk_acc[dt], ads, bq);
        }
      }
    }
  }

  uint16_t* dkb = dk + kv_head * seq * D;
  uint16_t* dvb = dv + kv_head * seq * D;
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
    const int col = dt * 8 + 2 * t4;
    if (key_a < seq) {
      *reinterpret_cast<uint32_t*>(dkb + key_a * D + col) =
          pack2<T>(dk_acc[dt][0] * scale, dk_acc[dt][1] * scale);
      *reinterpret_cast<uint32_t*>(dvb + key_a * D + col) = pack2<T>(dv_acc[dt][0], dv_acc[dt][1]);
    }
    if (key_b < seq) {
      *reinterpret_cast<uint32_t*>(dkb + key_b * D + col) =
          pack2<T>(dk_acc[dt][2] * scale, dk_acc[dt][3] * scale);
      *reinterpret_cast<uint32_t*>(dvb + key_b * D + col) = pack2<T>(dv_acc[dt][2], dv_acc[dt][3]);
    }
  }
}

// ---- tensor-core backward: dQ ---------------------------------------------------------------

template <int D>
struct DqTiles {
  static constexpr int kRows = 64, kKeys = 32, kLd = D + 8, kLdT = kKeys + 8;
  static constexpr size_t kSmem = sizeof(uint16_t) * (2 * kRows * kLd + 2 * kKeys * kLd + D * kLdT);
};

template <typename T, int D>
__global__ void __launch_bounds__(kBlockThreads)
    flash_backward_dq_kernel(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                             const uint16_t* dout, const float* lse, const float* delta,
                             uint16_t* dq, int heads_q, int group, int64_t seq, float scale_log2,
                             float scale) {
  using Tiles = DqTiles<D>;
  constexpr int BQ = Tiles::kRows, BK = Tiles::kKeys, LD = Tiles::kLd, LDT = Tiles::kLdT;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint16_t* qs = reinterpret_cast<uint16_t*>(smem_raw);
  uint16_t* dos = qs + BQ * LD;
  uint16_t* ks = dos + BQ * LD;
  uint16_t* vs = ks + BK * LD;
  uint16_t* kt = vs + BK * LD;

  const int64_t tile = gridDim.x - 1 - blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z;
  const int heads_kv = heads_q / group;
  const int64_t head = static_cast<int64_t>(b) * heads_q + h;
  const int64_t kv_head = static_cast<int64_t>(b) * heads_kv + h / group;
  const uint16_t* kb = k + kv_head * seq * D;
  const uint16_t* vb = v + kv_head * seq * D;
  const int64_t q0 = tile * BQ;
  load_rows<BQ, D, LD>(qs, q + head * seq * D, q0, seq);
  load_rows<BQ, D, LD>(dos, dout + head * seq * D, q0, seq);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const int64_t row_a = q0 + warp * 16 + g, row_b = row_a + 8;
  const float lse_a = row_a < seq ? lse[head * seq + row_a] * kLog2e : INFINITY;
  const float lse_b = row_b < seq ? lse[head * seq + row_b] * kLog2e : INFINITY;
  const float delta_a = row_a < seq ? delta[head * seq + row_a] : 0.0f;
  const float delta_b = row_b < seq ? delta[head * seq + row_b] : 0.0f;
  float dq_acc[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) dq_acc[i][0] = dq_acc[i][1] = dq_acc[i][2] = dq_acc[i][3] = 0.0f;

  const int64_t last_row = min(q0 + BQ, seq) - 1;
  const int64_t tiles = last_row / BK + 1;
  for (int64_t kt_i = 0; kt_i < tiles; ++kt_i) {
    const int64_t k0 = kt_i * BK;
    __syncthreads();
    load_rows<BK, D, LD>(ks, kb, k0, seq);
    load_rows<BK, D, LD>(vs, vb, k0, seq);
    load_rows_transposed<BK, D, LDT>(kt, kb, k0, seq);
    __syncthreads();

    float s[BK / 8][4], dp[BK / 8][4];
#pragma unroll
    for (int i = 0; i < BK / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[i][e] = dp[i][e] = 0.0f;
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
      uint32_t aq[4], ad[4];
      load_a(qs, LD, warp * 16, kc * 16, aq);
      load_a(dos, LD, warp * 16, kc * 16, ad);
#pragma unroll
      for (int nt = 0; nt < BK / 8; ++nt) {
        uint32_t bk[2], bv[2];
        load_b(ks, LD, nt * 8, kc * 16, bk);
        load_b(vs, LD, nt * 8, kc * 16, bv);
        mma<T>(s[nt], aq, bk);
        mma<T>(dp[nt], ad, bv);
      }
    }
#pragma unroll
    for (int nt = 0; nt < BK / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t key = k0 + nt * 8 + 2 * t4 + (e & 1);
        const int64_t row = e < 2 ? row_a : row_b;
        float p = exp2f(s[nt][e] * scale_log2 - (e < 2 ? lse_a : lse_b));
        if (key > row || key >= seq || row >= seq) p = 0.0f;
        s[nt][e] = p * (dp[nt][e] - (e < 2 ? delta_a : delta_b));  // dS
      }
    }
#pragma unroll
    for (int kc = 0; kc < BK / 16; ++kc) {
      const uint32_t a[4] = {pack2<T>(s[2 * kc][0], s[2 * kc][1]),
                             pack2<T>(s[2 * kc][2], s[2 * kc][3]),
                             pack2<T>(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                             pack2<T>(s[2 * kc + 1][2], s[2 * kc + 1][3])};
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        uint32_t bb[2];
        load_b(kt, LDT, dt * 8, kc * 16, bb);
        mma<T>(dq_acc[dt], a, bb);
      }
    }
  }

  uint16_t* dqb = dq + head * seq * D;
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
    const int col = dt * 8 + 2 * t4;
    if (row_a < seq)
      *reinterpret_cast<uint32_t*>(dqb + row_a * D + col) =
          pack2<T>(dq_acc[dt][0] * scale, dq_acc[dt][1] * scale);
    if (row_b < seq)
      *reinterpret_cast<uint32_t*>(dqb + row_b * D + col) =
          pack2<T>(dq_acc[dt][2] * scale, dq_acc[dt][3] * scale);
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

// delta[row] = sum_d dout[row, d] * out[row, d]
template <typename T>
__global__ void delta_kernel(const T* out, const T* dout, float* delta, int64_t rows, int D) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kSimtWarps + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int lane = threadIdx.x & 31;
  float s = 0.0f;
  for (int d = lane; d < D; d += 32) s += to_float(out[row * D + d]) * to_float(dout[row * D + d]);
  s = warp_sum(s);
  if (lane == 0) delta[row] = s;
}

// ---- launching ------------------------------------------------------------------------------

template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  // Above 48 KiB a kernel must opt in; the attribute is per device, so set it on every launch
  // (a cheap call) rather than tracking devices.
  ST_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(bytes)));
}

bool tensor_core_path(DType type, int64_t head_dim, std::initializer_list<const void*> ptrs) {
  if (!attention_uses_tensor_cores(type, head_dim)) return false;
  for (const void* p : ptrs)
    if (!aligned(p, 16)) return false;
  return true;
}

template <typename T, int D>
void tc_forward(const AttentionDims& d, const void* q, const void* k, const void* v, void* out,
                float* lse, cudaStream_t stream) {
  using Tiles = FwdTiles<D>;
  auto kernel = flash_forward_kernel<T, D>;
  allow_smem(kernel, Tiles::kSmem);
  const dim3 grid(ceil_div(d.seq, Tiles::kRows), static_cast<unsigned>(d.heads_q),
                  static_cast<unsigned>(d.batch));
  kernel<<<grid, kBlockThreads, Tiles::kSmem, stream>>>(
      static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(k),
      static_cast<const uint16_t*>(v), static_cast<uint16_t*>(out), lse,
      static_cast<int>(d.heads_q), static_cast<int>(d.heads_q / d.heads_kv), d.seq,
      d.scale * kLog2e);
  ST_CHECK_LAUNCH();
}

template <typename T, int D>
void tc_backward(const AttentionDims& d, const void* q, const void* k, const void* v,
                 const void* dout, const float* lse, const float* delta, void* dq, void* dk,
                 void* dv, cudaStream_t stream) {
  const int heads_q = static_cast<int>(d.heads_q);
  const int group = static_cast<int>(d.heads_q / d.heads_kv);
  const auto* q16 = static_cast<const uint16_t*>(q);
  const auto* k16 = static_cast<const uint16_t*>(k);
  const auto* v16 = static_cast<const uint16_t*>(v);
  const auto* do16 = static_cast<const uint16_t*>(dout);
  {
    using Tiles = DkDvTiles<D>;
    auto kernel = flash_backward_dkdv_kernel<T, D>;
    allow_smem(kernel, Tiles::kSmem);
    const dim3 grid(ceil_div(d.seq, Tiles::kKeys), static_cast<unsigned>(d.heads_kv),
                    static_cast<unsigned>(d.batch));
    kernel<<<grid, kBlockThreads, Tiles::kSmem, stream>>>(
        q16, k16, v16, do16, lse, delta, static_cast<uint16_t*>(dk), static_cast<uint16_t*>(dv),
        heads_q, group, d.seq, d.scale * kLog2e, d.scale);
    ST_CHECK_LAUNCH();
  }
  {
    using Tiles = DqTiles<D>;
    auto kernel = flash_backward_dq_kernel<T, D>;
    allow_smem(kernel, Tiles::kSmem);
    const dim3 grid(ceil_div(d.seq, Tiles::kRows), static_cast<unsigned>(d.heads_q),
                    static_cast<unsigned>(d.batch));
    kernel<<<grid, kBlockThreads, Tiles::kSmem, stream>>>(q16, k16, v16, do16, lse, delta,
                                                          static_cast<uint16_t*>(dq), heads_q,
                                                          group, d.seq, d.scale * kLog2e, d.scale);
    ST_CHECK_LAUNCH();
  }
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
  ST_CHECK_SHAPE(d.heads_q <= 65535 && d.batch <= 65535, "attention: batch ", d.batch,
                 " and heads ", d.heads_q, " must each be at most 65535");
}

}  // namespace

bool attention_uses_tensor_cores(DType type, int64_t head_dim) {
  return (type == DType::BF16 || type == DType::F16) && (head_dim == 64 || head_dim == 128);
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
                        void* dk, void* dv, Scratch& scratch, cudaStream_t stream) {
  const int64_t rows = d.batch * d.heads_q * d.seq;
  if (rows == 0) return;
  check_dims(d);
  float* delta = static_cast<float*>(scratch.get(sizeof(float) * rows));
  const int heads_q = static_cast<int>(d.heads_q);
  const int group = static_cast<int>(d.heads_q / d.heads_kv);
  const int D = static_cast<int>(d.head_dim);
  ST_DISPATCH_FLOAT(type, T, {
    delta_kernel<T><<<ceil_div(rows, kSimtWarps), 32 * kSimtWarps, 0, stream>>>(
        static_cast<const T*>(out), static_cast<const T*>(dout), delta, rows, D);
    ST_CHECK_LAUNCH();
  });
  if (tensor_core_path(type, d.head_dim, {q, k, v, dout, dq, dk, dv})) {
    if (type == DType::BF16) {
      ST_DISPATCH_HEAD_DIM(d.head_dim, HD,
                           tc_backward<bf16, HD>(d, q, k, v, dout, lse, delta, dq, dk, dv, stream));
    } else {
      ST_DISPATCH_HEAD_DIM(d.head_dim, HD,
                           tc_backward<f16, HD>(d, q, k, v, dout, lse, delta, dq, dk, dv, stream));
    }
    return;
  }
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
