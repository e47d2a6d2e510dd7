// Tests of the stand-in cuBLAS/cuBLASLt (fake_cublas.cpp), called directly: products against a
// naive row-major reference, the heuristic's refusals, and the checks that exist to catch a
// caller's mistakes. Inputs are small multiples of 1/8, so every product and sum is exact in
// fp32 and the expected results do not depend on the order of the additions; only the final
// rounding to a 16-bit output type changes values, and that is computed with the CUDA headers'
// own conversions (the fake has its own).
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

int64_t element_size(cudaDataType type) {
  return type == CUDA_R_32F ? 4 : 2;
}

const char* type_name(cudaDataType type) {
  return type == CUDA_R_32F ? "f32" : type == CUDA_R_16BF ? "bf16" : "f16";
}

// `value` rounded to `type` (to nearest even) and back.
float round_to(cudaDataType type, float value) {
  if (type == CUDA_R_16BF) return __bfloat162float(__float2bfloat16(value));
  if (type == CUDA_R_16F) return __half2float(__float2half(value));
  return value;
}

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// Column-major matrices in memory: `batch` of them, rows x cols, with ld and a batch stride (in
// elements), in one of the three types, in 256-byte aligned storage as from cudaMalloc.
struct Stored {
  struct alignas(256) Block {
    unsigned char bytes[256];
  };

  cudaDataType type = CUDA_R_32F;
  int64_t rows = 0, cols = 0, ld = 0, stride = 0, batch = 1;
  std::vector<Block> memory;

  Stored(cudaDataType type_, int64_t rows_, int64_t cols_, int64_t ld_, int64_t stride_,
         int64_t batch_, float fill)
      : type(type_), rows(rows_), cols(cols_), ld(ld_), stride(stride_), batch(batch_) {
    const int64_t bytes = elements() * element_size(type);
    memory.resize(static_cast<size_t>(bytes / 256 + 1));
    for (int64_t i = 0; i < elements(); ++i) set(i, fill);
  }

  int64_t elements() const { return (batch - 1) * stride + (cols - 1) * ld + rows; }
  int64_t at(int64_t b, int64_t r, int64_t c) const { return b * stride + c * ld + r; }
  void* data() { return memory.data(); }
  const void* data() const { return memory.data(); }

  float get(int64_t i) const {
    const unsigned char* p = static_cast<const unsigned char*>(data()) + i * element_size(type);
    if (type == CUDA_R_32F) {
      float f;
      std::memcpy(&f, p, sizeof(f));
      return f;
    }
    if (type == CUDA_R_16BF) {
      __nv_bfloat16 h;
      std::memcpy(&h, p, sizeof(h));
      return __bfloat162float(h);
    }
    __half h;
    std::memcpy(&h, p, sizeof(h));
    return __half2float(h);
  }

  void set(int64_t i, float value) {
    unsigned char* p = static_cast<unsigned char*>(data()) + i * element_size(type);
    if (type == CUDA_R_32F) {
      std::memcpy(p, &value, sizeof(value));
    } else if (type == CUDA_R_16BF) {
      const __nv_bfloat16 h = __float2bfloat16(value);
      std::memcpy(p, &h, sizeof(h));
    } else {
      const __half h = __float2half(value);
      std::memcpy(p, &h, sizeof(h));
    }
  }
};

// Row-major matrices, one per batch entry: the reference's view.
struct RowMajor {
  int64_t rows = 0, cols = 0, batch = 1;
  std::vector<float> values;

  RowMajor(int64_t rows_, int64_t cols_, int64_t batch_)
      : rows(rows_),
        cols(cols_),
        batch(batch_),
        values(static_cast<size_t>(rows_ * cols_ * batch_)) {}
  float& operator()(int64_t b, int64_t i, int64_t j) {
    return values[static_cast<size_t>((b * rows + i) * cols + j)];
  }
};

// Multiples of 1/8 in [-1, 1]: exact in every type, with exact products and sums in fp32.
void fill_random(RowMajor& x, std::mt19937& rng) {
  std::uniform_int_distribution<int> eighths(-8, 8);
  for (float& v : x.values) v = static_cast<float>(eighths(rng)) / 8.0f;
}

int64_t round_up(int64_t x, int64_t multiple) {
  return (x + multiple - 1) / multiple * multiple;
}

struct Case {
  cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
  int64_t m = 5, n = 7, k = 9, batch = 1;
  cudaDataType in = CUDA_R_32F, out = CUDA_R_32F;
  float alpha = 1, beta = 0;
  int64_t ld_pad = 0, stride_pad = 0;
  bool broadcast_a = false;  // batch stride 0 for A: one matrix for every batch entry
  bool nan_c = false;        // C holds NaN (with beta 0, which must not read it)

  std::string describe() const {
    return std::string(ta == CUBLAS_OP_T ? "T" : "N") + (tb == CUBLAS_OP_T ? "T" : "N") +
           " m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k) +
           " batch=" + std::to_string(batch) + " " + type_name(in) + "->" + type_name(out) +
           " alpha=" + std::to_string(alpha) + " beta=" + std::to_string(beta) +
           " ld_pad=" + std::to_string(ld_pad) + " stride_pad=" + std::to_string(stride_pad) +
           (broadcast_a ? " broadcast A" : "") + (nan_c ? " NaN C" : "");
  }
};

// The operands of a case in column-major storage, with the expected result. Elements outside
// the matrices (ld and stride padding) hold NaN in the inputs, which would show in the result
// if read, and 1000 in C, which must be left as it is.
struct Operands {
  Stored a, b, c;
  std::vector<float> expected;  // by Stored::at of c
};

Operands prepare(const Case& t, int64_t ld_multiple, uint32_t seed) {
  std::mt19937 rng(seed);
  const bool ta = t.ta == CUBLAS_OP_T, tb = t.tb == CUBLAS_OP_T;
  RowMajor op_a(t.m, t.k, t.broadcast_a ? 1 : t.batch), op_b(t.k, t.n, t.batch),
      c(t.m, t.n, t.batch);
  fill_random(op_a, rng);
  fill_random(op_b, rng);
  fill_random(c, rng);
  if (t.nan_c) std::fill(c.values.begin(), c.values.end(), kNaN);

  auto stored = [&](cudaDataType type, int64_t rows, int64_t cols, bool broadcast, float fill) {
    const int64_t ld = round_up(rows + t.ld_pad, ld_multiple);
    const int64_t stride = broadcast ? 0 : round_up(ld * cols + t.stride_pad, ld_multiple);
    return Stored(type, rows, cols, ld, stride, t.batch, fill);
  };
  Operands o{stored(t.in, ta ? t.k : t.m, ta ? t.m : t.k, t.broadcast_a, kNaN),
             stored(t.in, tb ? t.n : t.k, tb ? t.k : t.n, false, kNaN),
             stored(t.out, t.m, t.n, false, 1000.0f),
             {}};
  for (int64_t b = 0; b < op_a.batch; ++b)
    for (int64_t i = 0; i < t.m; ++i)
      for (int64_t l = 0; l < t.k; ++l)
        o.a.set(ta ? o.a.at(b, l, i) : o.a.at(b, i, l), op_a(b, i, l));
  for (int64_t b = 0; b < t.batch; ++b)
    for (int64_t l = 0; l < t.k; ++l)
      for (int64_t j = 0; j < t.n; ++j)
        o.b.set(tb ? o.b.at(b, j, l) : o.b.at(b, l, j), op_b(b, l, j));

  o.expected.resize(static_cast<size_t>(o.c.elements()));
  for (int64_t i = 0; i < o.c.elements(); ++i) o.expected[i] = o.c.get(i);  // the padding
  for (int64_t b = 0; b < t.batch; ++b) {
    for (int64_t i = 0; i < t.m; ++i) {
      for (int64_t j = 0; j < t.n; ++j) {
        o.c.set(o.c.at(b, i, j), c(b, i, j));
        float sum = 0;
        for (int64_t l = 0; l < t.k; ++l) sum += op_a(t.broadcast_a ? 0 : b, i, l) * op_b(b, l, j);
        float value = t.alpha * sum;
        if (t.beta != 0) value += t.beta * c(b, i, j);
        o.expected[static_cast<size_t>(o.c.at(b, i, j))] = round_to(t.out, value);
      }
    }
  }
  return o;
}

// Every element of the output buffer, matrices and padding, bit for bit.
void expect_result(const Operands& o) {
  int mismatches = 0;
  for (int64_t i = 0; i < o.c.elements() && mismatches < 10; ++i) {
    const float got = o.c.get(i), want = o.expected[static_cast<size_t>(i)];
    if (bits(got) != bits(want)) {
      ADD_FAILURE() << "element " << i << " of C: got " << got << ", expected " << want;
      ++mismatches;
    }
  }
  EXPECT_EQ(mismatches, 0);
}

// cuBLASLt objects for one product, released at the end of a test.
struct Lt {
  cublasLtHandle_t handle = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;

  Lt() {
    EXPECT_EQ(cublasLtCreate(&handle), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
              CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cublasLtMatmulPreferenceCreate(&pref), CUBLAS_STATUS_SUCCESS);
  }
  Lt(const Lt&) = delete;
  Lt& operator=(const Lt&) = delete;
  ~Lt() {
    for (cublasLtMatrixLayout_t l : {a, b, c, d})
      if (l != nullptr) cublasLtMatrixLayoutDestroy(l);
    if (pref != nullptr) cublasLtMatmulPreferenceDestroy(pref);
    if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
    if (handle != nullptr) cublasLtDestroy(handle);
  }

  void transposes(cublasOperation_t ta, cublasOperation_t tb) {
    EXPECT_EQ(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)),
              CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)),
              CUBLAS_STATUS_SUCCESS);
  }

  static cublasLtMatrixLayout_t layout(const Stored& s) {
    cublasLtMatrixLayout_t l = nullptr;
    EXPECT_EQ(cublasLtMatrixLayoutCreate(&l, s.type, static_cast<uint64_t>(s.rows),
                                         static_cast<uint64_t>(s.cols), s.ld),
              CUBLAS_STATUS_SUCCESS);
    if (s.batch > 1) {
      const auto count = static_cast<int32_t>(s.batch);
      EXPECT_EQ(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
                                                 sizeof(count)),
                CUBLAS_STATUS_SUCCESS);
      EXPECT_EQ(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                 &s.stride, sizeof(s.stride)),
                CUBLAS_STATUS_SUCCESS);
    }
    return l;
  }

  void alignments(uint32_t a_bytes, uint32_t b_bytes, uint32_t c_bytes, uint32_t d_bytes) {
    const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> values[] = {
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, a_bytes},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, b_bytes},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, c_bytes},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, d_bytes}};
    for (const auto& [attr, bytes] : values)
      EXPECT_EQ(cublasLtMatmulPreferenceSetAttribute(pref, attr, &bytes, sizeof(bytes)),
                CUBLAS_STATUS_SUCCESS);
  }

  // Returns the heuristic's status; `algo` and `count` receive its answer.
  cublasStatus_t heuristic(cublasLtMatmulAlgo_t* algo, int* count,
                           cublasLtMatmulHeuristicResult_t* result_out = nullptr) {
    cublasLtMatmulHeuristicResult_t result{};
    const cublasStatus_t status =
        cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, c, d, pref, 1, &result, count);
    *algo = result.algo;
    if (result_out != nullptr) *result_out = result;
    return status;
  }
};

// Runs a case through cuBLASLt as the CUDA backend does: C and D one buffer with one layout,
// operands promised 16-byte alignment (their lds and strides are multiples of 8 elements).
void run_lt(const Case& t, uint32_t seed) {
  SCOPED_TRACE("cublasLtMatmul " + t.describe());
  Operands o = prepare(t, 8, seed);
  Lt lt;
  lt.transposes(t.ta, t.tb);
  lt.a = Lt::layout(o.a);
  lt.b = Lt::layout(o.b);
  lt.c = Lt::layout(o.c);
  lt.d = Lt::layout(o.c);
  lt.alignments(16, 16, 16, 16);
  cublasLtMatmulAlgo_t algo;
  int count = -1;
  ASSERT_EQ(lt.heuristic(&algo, &count), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(count, 1);
  ASSERT_EQ(cublasLtMatmul(lt.handle, lt.desc, &t.alpha, o.a.data(), lt.a, o.b.data(), lt.b,
                           &t.beta, o.c.data(), lt.c, o.c.data(), lt.d, &algo, nullptr, 0, nullptr),
            CUBLAS_STATUS_SUCCESS);
  expect_result(o);
}

// Runs a case through cublasGemmStridedBatchedEx, with lds and strides of any alignment.
void run_classic(const Case& t, uint32_t seed) {
  SCOPED_TRACE("cublasGemmStridedBatchedEx " + t.describe());
  Operands o = prepare(t, 1, seed);
  cublasHandle_t h = nullptr;
  ASSERT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasSetStream(h, nullptr), CUBLAS_STATUS_SUCCESS);
  Stored workspace(CUDA_R_32F, 256, 1, 256, 0, 1, 0);
  EXPECT_EQ(cublasSetWorkspace(h, workspace.data(), 1024), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasGemmStridedBatchedEx(
                h, t.ta, t.tb, static_cast<int>(t.m), static_cast<int>(t.n), static_cast<int>(t.k),
                &t.alpha, o.a.data(), t.in, static_cast<int>(o.a.ld), o.a.stride, o.b.data(), t.in,
                static_cast<int>(o.b.ld), o.b.stride, &t.beta, o.c.data(), t.out,
                static_cast<int>(o.c.ld), o.c.stride, static_cast<int>(t.batch), CUBLAS_COMPUTE_32F,
                CUBLAS_GEMM_DEFAULT),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasDestroy(h), CUBLAS_STATUS_SUCCESS);
  expect_result(o);
}

// Every transpose pair, every supported type combination, and three shapes of problem: packed
// with beta 0 over NaN; padded lds, three batch entries with padded strides, alpha and beta not
// 1; two batch entries sharing one A, accumulating into C with beta 1.
std::vector<Case> cases() {
  const std::pair<cudaDataType, cudaDataType> types[] = {{CUDA_R_32F, CUDA_R_32F},
                                                         {CUDA_R_16BF, CUDA_R_16BF},
                                                         {CUDA_R_16BF, CUDA_R_32F},
                                                         {CUDA_R_16F, CUDA_R_16F},
                                                         {CUDA_R_16F, CUDA_R_32F}};
  std::vector<Case> all;
  for (const cublasOperation_t ta : {CUBLAS_OP_N, CUBLAS_OP_T})
    for (const cublasOperation_t tb : {CUBLAS_OP_N, CUBLAS_OP_T})
      for (const auto& [in, out] : types) {
        Case t;
        t.ta = ta;
        t.tb = tb;
        t.in = in;
        t.out = out;
        t.nan_c = true;
        all.push_back(t);

        t.nan_c = false;
        t.m = 6;
        t.n = 3;
        t.k = 13;
        t.batch = 3;
        t.ld_pad = 3;
        t.stride_pad = 5;
        t.alpha = 1.5f;
        t.beta = -0.5f;
        all.push_back(t);

        t.m = 4;
        t.n = 9;
        t.k = 16;
        t.batch = 2;
        t.ld_pad = 1;
        t.stride_pad = 0;
        t.alpha = 1;
        t.beta = 1;
        t.broadcast_a = true;
        all.push_back(t);
      }
  return all;
}

TEST(FakeCublasLt, MatchesRowMajorReference) {
  uint32_t seed = 1;
  for (const Case& t : cases()) run_lt(t, seed++);
}

TEST(FakeCublas, GemmStridedBatchedExMatchesRowMajorReference) {
  uint32_t seed = 1;
  for (const Case& t : cases()) run_classic(t, seed++);
}

// The column-major convention itself, with numbers worked by hand: A = [1 2 3; 4 5 6] is stored
// 1 4 2 5 3 6, B = [7 8; 9 10; 11 12] is stored 7 9 11 8 10 12, A B = [58 64; 139 154].
TEST(FakeCublas, ColumnMajorByHand) {
  const float a[] = {1, 4, 2, 5, 3, 6}, b[] = {7, 9, 11, 8, 10, 12};
  const float alpha = 1, beta = 0;
  {
    float d[4] = {kNaN, kNaN, kNaN, kNaN};
    cublasHandle_t h = nullptr;
    ASSERT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cublasGemmStridedBatchedEx(
                  h, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 3, &alpha, a, CUDA_R_32F, 2, 0, b, CUDA_R_32F,
                  3, 0, &beta, d, CUDA_R_32F, 2, 0, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
              CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(d[0], 58);
    EXPECT_EQ(d[1], 139);
    EXPECT_EQ(d[2], 64);
    EXPECT_EQ(d[3], 154);
    // B^T A^T = (A B)^T, with the same storage read transposed: [58 139; 64 154].
    ASSERT_EQ(cublasGemmStridedBatchedEx(
                  h, CUBLAS_OP_T, CUBLAS_OP_T, 2, 2, 3, &alpha, b, CUDA_R_32F, 3, 0, a, CUDA_R_32F,
                  2, 0, &beta, d, CUDA_R_32F, 2, 0, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
              CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(d[0], 58);
    EXPECT_EQ(d[1], 64);
    EXPECT_EQ(d[2], 139);
    EXPECT_EQ(d[3], 154);
    EXPECT_EQ(cublasDestroy(h), CUBLAS_STATUS_SUCCESS);
  }
  {
    Stored sa(CUDA_R_32F, 2, 3, 2, 0, 1, 0), sb(CUDA_R_32F, 3, 2, 3, 0, 1, 0),
        sd(CUDA_R_32F, 2, 2, 2, 0, 1, kNaN);
    for (int i = 0; i < 6; ++i) {
      sa.set(i, a[i]);
      sb.set(i, b[i]);
    }
    Lt lt;
    lt.a = Lt::layout(sa);
    lt.b = Lt::layout(sb);
    lt.c = Lt::layout(sd);
    lt.d = Lt::layout(sd);
    lt.alignments(8, 4, 8, 8);  // what lds of 2, 3 and 2 floats allow
    cublasLtMatmulAlgo_t algo;
    int count = 0;
    ASSERT_EQ(lt.heuristic(&algo, &count), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cublasLtMatmul(lt.handle, lt.desc, &alpha, sa.data(), lt.a, sb.data(), lt.b, &beta,
                             sd.data(), lt.c, sd.data(), lt.d, &algo, nullptr, 0, nullptr),
              CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(sd.get(0), 58);
    EXPECT_EQ(sd.get(1), 139);
    EXPECT_EQ(sd.get(2), 64);
    EXPECT_EQ(sd.get(3), 154);
  }
}

// A 1 x 1 product over k = 2 in `type`, through both interfaces; returns both results. The lds
// of 8 elements keep every operand 16-byte aligned.
std::pair<float, float> dot2(cudaDataType type, float a0, float a1, float c, float beta) {
  Stored a(type, 1, 2, 8, 0, 1, 0), b(type, 2, 1, 8, 0, 1, 1), d_lt(type, 1, 1, 8, 0, 1, c),
      d_classic(type, 1, 1, 8, 0, 1, c);
  a.set(a.at(0, 0, 0), a0);
  a.set(a.at(0, 0, 1), a1);
  const float alpha = 1;
  Lt lt;
  lt.a = Lt::layout(a);
  lt.b = Lt::layout(b);
  lt.c = Lt::layout(d_lt);
  lt.d = Lt::layout(d_lt);
  lt.alignments(16, 16, 16, 16);
  cublasLtMatmulAlgo_t algo;
  int count = 0;
  EXPECT_EQ(lt.heuristic(&algo, &count), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtMatmul(lt.handle, lt.desc, &alpha, a.data(), lt.a, b.data(), lt.b, &beta,
                           d_lt.data(), lt.c, d_lt.data(), lt.d, &algo, nullptr, 0, nullptr),
            CUBLAS_STATUS_SUCCESS);
  cublasHandle_t h = nullptr;
  EXPECT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 1, 1, 2, &alpha, a.data(), type,
                                       8, 0, b.data(), type, 8, 0, &beta, d_classic.data(), type, 8,
                                       0, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasDestroy(h), CUBLAS_STATUS_SUCCESS);
  return {d_lt.get(0), d_classic.get(0)};
}

TEST(FakeCublas, RoundsToNearestEvenOnce) {
  // bf16 keeps 8 significant bits: between 1 and 1 + 2^-7, 1 + 2^-8 is a tie (to 1, the even
  // one) and 1 + 3 * 2^-8 lies between 1 + 2^-7 and 1 + 2^-6 (a tie, to 1 + 2^-6).
  EXPECT_EQ(dot2(CUDA_R_16BF, 1, 0x1p-8f, 0, 0), std::make_pair(1.0f, 1.0f));
  EXPECT_EQ(dot2(CUDA_R_16BF, 1, 0x3p-8f, 0, 0), std::make_pair(1.015625f, 1.015625f));
  // f16 keeps 11: the same ties one step of 2^-3 finer.
  EXPECT_EQ(dot2(CUDA_R_16F, 1, 0x1p-11f, 0, 0), std::make_pair(1.0f, 1.0f));
  EXPECT_EQ(dot2(CUDA_R_16F, 1, 0x3p-11f, 0, 0), std::make_pair(1.001953125f, 1.001953125f));
  // The product 2^-8 + 2^-16 plus C = 1 is 1 + 2^-8 + 2^-16, just past the tie: 1 + 2^-7. Had
  // the product been rounded to bf16 first (2^-8, a tie to even), the sum would be the tie
  // 1 + 2^-8 and round down to 1.
  EXPECT_EQ(dot2(CUDA_R_16BF, 0x1p-8f, 0x1p-16f, 1, 1), std::make_pair(1.0078125f, 1.0078125f));
}

TEST(FakeCublas, BetaZeroDoesNotReadCAndAlphaZeroDoesNotReadAB) {
  // beta 0 over C = NaN: the product alone.
  EXPECT_EQ(dot2(CUDA_R_32F, 2, 3, kNaN, 0), std::make_pair(5.0f, 5.0f));
  // alpha 0 with NaN in A: D = beta C, A and B unread.
  Stored a(CUDA_R_32F, 2, 2, 2, 0, 1, kNaN), b(CUDA_R_32F, 2, 2, 2, 0, 1, 1),
      c(CUDA_R_32F, 2, 2, 2, 0, 1, 3);
  const float alpha = 0, beta = 2;
  cublasHandle_t h = nullptr;
  ASSERT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(
      cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 2, &alpha, a.data(), CUDA_R_32F,
                                 2, 0, b.data(), CUDA_R_32F, 2, 0, &beta, c.data(), CUDA_R_32F, 2,
                                 0, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      CUBLAS_STATUS_SUCCESS);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(c.get(i), 6.0f) << i;
  EXPECT_EQ(cublasDestroy(h), CUBLAS_STATUS_SUCCESS);
}

TEST(FakeCublasLt, SeparateCAndD) {
  // C and D in different buffers with different lds: D = A B + C, C unchanged.
  Stored a(CUDA_R_32F, 2, 1, 2, 0, 1, 0), b(CUDA_R_32F, 1, 2, 1, 0, 1, 0),
      c(CUDA_R_32F, 2, 2, 3, 0, 1, 10), d(CUDA_R_32F, 2, 2, 4, 0, 1, -1);
  a.set(0, 1);
  a.set(1, 2);
  b.set(0, 3);
  b.set(1, 4);
  const float alpha = 1, beta = 1;
  Lt lt;
  lt.a = Lt::layout(a);
  lt.b = Lt::layout(b);
  lt.c = Lt::layout(c);
  lt.d = Lt::layout(d);
  lt.alignments(8, 4, 4, 16);  // what lds of 2, 1, 3 and 4 floats allow
  cublasLtMatmulAlgo_t algo;
  int count = 0;
  ASSERT_EQ(lt.heuristic(&algo, &count), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasLtMatmul(lt.handle, lt.desc, &alpha, a.data(), lt.a, b.data(), lt.b, &beta,
                           c.data(), lt.c, d.data(), lt.d, &algo, nullptr, 0, nullptr),
            CUBLAS_STATUS_SUCCESS);
  // A B = [3 4; 6 8]; D column-major with ld 4, its padding untouched.
  const float want[] = {13, 16, -1, -1, 14, 18};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(d.get(i), want[i]) << i;
  for (int i = 0; i < 5; ++i) EXPECT_EQ(c.get(i), 10.0f) << i;
}

// A bf16 problem whose operand alignments the test promises.
struct HeuristicCase {
  cudaDataType in, out;
  uint32_t a, b, c, d;
};

cublasStatus_t heuristic_for(const HeuristicCase& hc, int* count,
                             cublasLtMatmulHeuristicResult_t* result) {
  Stored a(hc.in, 8, 8, 8, 0, 1, 0), d(hc.out, 8, 8, 8, 0, 1, 0);
  Lt lt;
  lt.a = Lt::layout(a);
  lt.b = Lt::layout(a);
  lt.c = Lt::layout(d);
  lt.d = Lt::layout(d);
  lt.alignments(hc.a, hc.b, hc.c, hc.d);
  cublasLtMatmulAlgo_t algo;
  return lt.heuristic(&algo, count, result);
}

TEST(FakeCublasLt, HeuristicRefusesMisaligned16BitOperands) {
  int count = -1;
  cublasLtMatmulHeuristicResult_t result{};
  // 16-byte promises for 16-bit operands: one algorithm, without workspace.
  EXPECT_EQ(heuristic_for({CUDA_R_16BF, CUDA_R_16BF, 16, 16, 16, 16}, &count, &result),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(count, 1);
  EXPECT_EQ(result.state, CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(result.workspaceSize, 0u);
  EXPECT_EQ(result.wavesCount, 1.0f);
  // 8 bytes on any one 16-bit operand: none.
  const HeuristicCase refused[] = {{CUDA_R_16BF, CUDA_R_16BF, 8, 16, 16, 16},
                                   {CUDA_R_16BF, CUDA_R_16BF, 16, 8, 16, 16},
                                   {CUDA_R_16BF, CUDA_R_16BF, 16, 16, 8, 16},
                                   {CUDA_R_16BF, CUDA_R_16BF, 16, 16, 16, 8},
                                   {CUDA_R_16F, CUDA_R_32F, 2, 16, 16, 16},
                                   // 24 promises only 8 (its power of two).
                                   {CUDA_R_16F, CUDA_R_16F, 24, 16, 16, 16},
                                   // f32 elements need at least 4.
                                   {CUDA_R_32F, CUDA_R_32F, 4, 4, 4, 2}};
  for (const HeuristicCase& hc : refused) {
    count = -1;
    EXPECT_EQ(heuristic_for(hc, &count, &result), CUBLAS_STATUS_NOT_SUPPORTED)
        << hc.a << " " << hc.b << " " << hc.c << " " << hc.d;
    EXPECT_EQ(count, 0);
  }
  // f32 operands at 4 bytes, and an f32 output of 16-bit inputs at 4 bytes: available.
  EXPECT_EQ(heuristic_for({CUDA_R_32F, CUDA_R_32F, 4, 4, 4, 4}, &count, &result),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(count, 1);
  EXPECT_EQ(heuristic_for({CUDA_R_16BF, CUDA_R_32F, 16, 16, 4, 4}, &count, &result),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(count, 1);
}

TEST(FakeCublasLt, MatmulHoldsOperandsToTheHeuristicsPromise) {
  // Promised 16 bytes, A is then passed 2 bytes past an aligned address.
  Stored a(CUDA_R_16BF, 8, 9, 8, 0, 1, 1), b(CUDA_R_16BF, 8, 8, 8, 0, 1, 1),
      d(CUDA_R_16BF, 8, 8, 8, 0, 1, 7);
  Lt lt;
  lt.a = Lt::layout(Stored(CUDA_R_16BF, 8, 8, 8, 0, 1, 0));
  lt.b = Lt::layout(b);
  lt.c = Lt::layout(d);
  lt.d = Lt::layout(d);
  lt.alignments(16, 16, 16, 16);
  cublasLtMatmulAlgo_t algo;
  int count = 0;
  ASSERT_EQ(lt.heuristic(&algo, &count), CUBLAS_STATUS_SUCCESS);
  const float alpha = 1, beta = 0;
  const void* shifted = static_cast<const char*>(a.data()) + 2;
  EXPECT_EQ(cublasLtMatmul(lt.handle, lt.desc, &alpha, shifted, lt.a, b.data(), lt.b, &beta,
                           d.data(), lt.c, d.data(), lt.d, &algo, nullptr, 0, nullptr),
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(d.get(0), 7.0f);  // nothing written
  // An algorithm that did not come from the heuristic.
  cublasLtMatmulAlgo_t made_up{};
  EXPECT_EQ(cublasLtMatmul(lt.handle, lt.desc, &alpha, a.data(), lt.a, b.data(), lt.b, &beta,
                           d.data(), lt.c, d.data(), lt.d, &made_up, nullptr, 0, nullptr),
            CUBLAS_STATUS_INVALID_VALUE);
  // The same operands, aligned: 8 products of ones.
  EXPECT_EQ(cublasLtMatmul(lt.handle, lt.desc, &alpha, a.data(), lt.a, b.data(), lt.b, &beta,
                           d.data(), lt.c, d.data(), lt.d, &algo, nullptr, 0, nullptr),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(d.get(0), 8.0f);
  EXPECT_EQ(d.get(63), 8.0f);
}

TEST(FakeCublasLt, RejectsInconsistentShapes) {
  Stored a(CUDA_R_32F, 4, 3, 4, 0, 1, 1), b(CUDA_R_32F, 2, 5, 2, 0, 1, 1),
      d(CUDA_R_32F, 4, 5, 4, 0, 1, 7);
  const float alpha = 1, beta = 0;
  cublasLtMatmulAlgo_t algo;
  int count = -1;
  {
    Lt lt;  // op(A) is 4 x 3, op(B) 2 x 5: k differs
    lt.a = Lt::layout(a);
    lt.b = Lt::layout(b);
    lt.c = Lt::layout(d);
    lt.d = Lt::layout(d);
    EXPECT_EQ(lt.heuristic(&algo, &count), CUBLAS_STATUS_INVALID_VALUE);
    EXPECT_EQ(count, 0);
    EXPECT_EQ(cublasLtMatmul(lt.handle, lt.desc, &alpha, a.data(), lt.a, b.data(), lt.b, &beta,
                             d.data(), lt.c, d.data(), lt.d, nullptr, nullptr, 0, nullptr),
              CUBLAS_STATUS_INVALID_VALUE);
    EXPECT_EQ(d.get(0), 7.0f);
    // Transposing A makes op(A) 3 x 4, which matches neither.
    lt.transposes(CUBLAS_OP_T, CUBLAS_OP_N);
    EXPECT_EQ(lt.heuristic(&algo, &count), CUBLAS_STATUS_INVALID_VALUE);
  }
  {
    Lt lt;  // ld below the rows
    ASSERT_EQ(cublasLtMatrixLayoutCreate(&lt.a, CUDA_R_32F, 4, 2, 3), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cublasLtMatrixLayoutCreate(&lt.b, CUDA_R_32F, 2, 5, 2), CUBLAS_STATUS_SUCCESS);
    lt.c = Lt::layout(d);
    lt.d = Lt::layout(d);
    EXPECT_EQ(lt.heuristic(&algo, &count), CUBLAS_STATUS_INVALID_VALUE);
  }
  {
    Lt lt;  // batch counts that differ
    ASSERT_EQ(cublasLtMatrixLayoutCreate(&lt.a, CUDA_R_32F, 4, 2, 4), CUBLAS_STATUS_SUCCESS);
    lt.b = Lt::layout(Stored(CUDA_R_32F, 2, 5, 2, 10, 2, 0));
    lt.c = Lt::layout(d);
    lt.d = Lt::layout(d);
    EXPECT_EQ(lt.heuristic(&algo, &count), CUBLAS_STATUS_INVALID_VALUE);
  }
  {
    Lt lt;  // f32 inputs with a bf16 output: not a combination the library has
    lt.a = Lt::layout(Stored(CUDA_R_32F, 4, 2, 4, 0, 1, 0));
    lt.b = Lt::layout(Stored(CUDA_R_32F, 2, 5, 2, 0, 1, 0));
    lt.c = Lt::layout(Stored(CUDA_R_16BF, 4, 5, 4, 0, 1, 0));
    lt.d = Lt::layout(Stored(CUDA_R_16BF, 4, 5, 4, 0, 1, 0));
    EXPECT_EQ(lt.heuristic(&algo, &count), CUBLAS_STATUS_NOT_SUPPORTED);
  }
}

TEST(FakeCublasLt, RejectsWhatItDoesNotModel) {
  Lt lt;
  const int32_t row = CUBLASLT_ORDER_ROW;
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&lt.a, CUDA_R_32F, 4, 4, 4), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtMatrixLayoutSetAttribute(lt.a, CUBLASLT_MATRIX_LAYOUT_ORDER, &row, sizeof(row)),
            CUBLAS_STATUS_NOT_SUPPORTED);
  const int64_t batch64 = 2;  // BATCH_COUNT is an int32_t
  EXPECT_EQ(cublasLtMatrixLayoutSetAttribute(lt.a, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch64,
                                             sizeof(batch64)),
            CUBLAS_STATUS_INVALID_VALUE);
  const uint32_t relu = CUBLASLT_EPILOGUE_RELU, none = CUBLASLT_EPILOGUE_DEFAULT;
  EXPECT_EQ(
      cublasLtMatmulDescSetAttribute(lt.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &relu, sizeof(relu)),
      CUBLAS_STATUS_NOT_SUPPORTED);
  EXPECT_EQ(
      cublasLtMatmulDescSetAttribute(lt.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &none, sizeof(none)),
      CUBLAS_STATUS_SUCCESS);
  const cublasOperation_t conj = CUBLAS_OP_C;
  EXPECT_EQ(
      cublasLtMatmulDescSetAttribute(lt.desc, CUBLASLT_MATMUL_DESC_TRANSA, &conj, sizeof(conj)),
      CUBLAS_STATUS_NOT_SUPPORTED);
  const void* bias = nullptr;
  EXPECT_EQ(cublasLtMatmulDescSetAttribute(lt.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                           sizeof(bias)),
            CUBLAS_STATUS_NOT_SUPPORTED);
  cublasLtMatmulDesc_t tf32 = nullptr;
  EXPECT_EQ(cublasLtMatmulDescCreate(&tf32, CUBLAS_COMPUTE_32F_FAST_TF32, CUDA_R_32F),
            CUBLAS_STATUS_NOT_SUPPORTED);
  EXPECT_EQ(tf32, nullptr);
  const float waves = 2;
  EXPECT_EQ(cublasLtMatmulPreferenceSetAttribute(lt.pref, CUBLASLT_MATMUL_PREF_MAX_WAVES_COUNT,
                                                 &waves, sizeof(waves)),
            CUBLAS_STATUS_NOT_SUPPORTED);
}

TEST(FakeCublas, RejectsOutputsThatOverlap) {
  const float alpha = 1, beta = 0;
  cublasHandle_t h = nullptr;
  ASSERT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
  Stored a(CUDA_R_32F, 2, 2, 2, 4, 2, 1), c(CUDA_R_32F, 2, 2, 2, 4, 2, 7);
  // Two batch entries 3 elements apart: the second matrix's first column is the first's last.
  EXPECT_EQ(
      cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 2, &alpha, a.data(), CUDA_R_32F,
                                 2, 4, a.data(), CUDA_R_32F, 2, 4, &beta, c.data(), CUDA_R_32F, 2,
                                 3, 2, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(c.get(0), 7.0f);
  // The output written over an input.
  EXPECT_EQ(
      cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 2, &alpha, c.data(), CUDA_R_32F,
                                 2, 4, a.data(), CUDA_R_32F, 2, 4, &beta, c.data(), CUDA_R_32F, 2,
                                 4, 2, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(c.get(0), 7.0f);
  // Interleaved but disjoint: ld 4 with the second entry 2 rows down. Each output is 2.
  Stored d(CUDA_R_32F, 2, 2, 4, 2, 2, 7);
  EXPECT_EQ(
      cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 2, &alpha, a.data(), CUDA_R_32F,
                                 2, 4, a.data(), CUDA_R_32F, 2, 4, &beta, d.data(), CUDA_R_32F, 4,
                                 2, 2, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      CUBLAS_STATUS_SUCCESS);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(d.get(i), 2.0f) << i;
  EXPECT_EQ(cublasDestroy(h), CUBLAS_STATUS_SUCCESS);

  // cuBLASLt: a batch stride of 0 for D.
  Lt lt;
  lt.a = Lt::layout(a);
  lt.b = Lt::layout(a);
  lt.c = Lt::layout(Stored(CUDA_R_32F, 2, 2, 2, 0, 2, 0));
  lt.d = Lt::layout(Stored(CUDA_R_32F, 2, 2, 2, 0, 2, 0));
  EXPECT_EQ(cublasLtMatmul(lt.handle, lt.desc, &alpha, a.data(), lt.a, a.data(), lt.b, &beta,
                           c.data(), lt.c, c.data(), lt.d, nullptr, nullptr, 0, nullptr),
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(c.get(0), 7.0f);
}

TEST(FakeCublas, ClassicArgumentChecks) {
  cublasHandle_t h = nullptr;
  ASSERT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
  Stored a(CUDA_R_16BF, 3, 3, 3, 0, 1, 1), c(CUDA_R_16BF, 3, 3, 3, 0, 1, 7),
      workspace(CUDA_R_32F, 128, 1, 128, 0, 1, 0);
  const float alpha = 1, beta = 0;
  // The workspace must be 256-byte aligned.
  EXPECT_EQ(cublasSetWorkspace(h, static_cast<char*>(workspace.data()) + 16, 256),
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(cublasSetWorkspace(h, workspace.data(), 256), CUBLAS_STATUS_SUCCESS);
  // lda below the rows of A.
  EXPECT_EQ(
      cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 3, 3, 3, &alpha, a.data(),
                                 CUDA_R_16BF, 2, 0, a.data(), CUDA_R_16BF, 3, 0, &beta, c.data(),
                                 CUDA_R_16BF, 3, 0, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      CUBLAS_STATUS_INVALID_VALUE);
  // Inputs of two types, and a fast compute type.
  EXPECT_EQ(
      cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 3, 3, 3, &alpha, a.data(),
                                 CUDA_R_16BF, 3, 0, a.data(), CUDA_R_16F, 3, 0, &beta, c.data(),
                                 CUDA_R_16BF, 3, 0, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      CUBLAS_STATUS_NOT_SUPPORTED);
  EXPECT_EQ(cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 3, 3, 3, &alpha, a.data(),
                                       CUDA_R_16BF, 3, 0, a.data(), CUDA_R_16BF, 3, 0, &beta,
                                       c.data(), CUDA_R_16BF, 3, 0, 1, CUBLAS_COMPUTE_32F_FAST_16BF,
                                       CUBLAS_GEMM_DEFAULT),
            CUBLAS_STATUS_NOT_SUPPORTED);
  EXPECT_EQ(c.get(0), 7.0f);
  // Odd lds and a 2-byte offset are fine here (the fallback's purpose): 3 products of ones.
  const void* shifted = static_cast<const char*>(a.data()) + 2;
  EXPECT_EQ(
      cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 2, 3, 3, &alpha, shifted, CUDA_R_16BF,
                                 3, 0, a.data(), CUDA_R_16BF, 3, 0, &beta, c.data(), CUDA_R_16BF, 3,
                                 0, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(c.get(0), 3.0f);
  EXPECT_EQ(c.get(2), 7.0f);  // row 3 is outside m = 2
  EXPECT_EQ(cublasDestroy(h), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasDestroy(nullptr), CUBLAS_STATUS_NOT_INITIALIZED);
}

TEST(FakeCublas, StatusStrings) {
  EXPECT_NE(std::string(cublasGetStatusString(CUBLAS_STATUS_NOT_SUPPORTED)).find("NOT_SUPPORTED"),
            std::string::npos);
  EXPECT_NE(std::string(cublasGetStatusString(CUBLAS_STATUS_INVALID_VALUE)).find("INVALID_VALUE"),
            std::string::npos);
  EXPECT_NE(std::string(cublasGetStatusString(CUBLAS_STATUS_SUCCESS)).find("SUCCESS"),
            std::string::npos);
}

}  // namespace
