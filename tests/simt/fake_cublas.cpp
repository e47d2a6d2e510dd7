// A stand-in for cuBLAS and cuBLASLt, so that the CUDA backend's matrix products
// (src/backend/cuda/gemm.cpp) run on the CPU beside the fake CUDA runtime. It defines the calls
// gemm.cpp makes, with the real headers' signatures, and models them from NVIDIA's documentation:
//   - column-major matrices, op(A) m x k times op(B) k x n, D = alpha op(A) op(B) + beta C, with
//     strided batches; A and B in one of f32, bf16, f16, and C/D in that type or (for 16-bit
//     inputs) f32, compute type CUBLAS_COMPUTE_32F, alpha and beta host floats;
//   - every dot product summed in fp32 in k order, the result rounded once to D's type (to
//     nearest, ties to even); C is not read when beta is 0, nor A and B when alpha is 0;
//   - "device" pointers are host pointers, and every call has finished when it returns (streams
//     are accepted and ignored, as the fake runtime runs all work in program order).
// Its purpose is to catch the caller's mistakes, so it checks more than the library reports:
// dimensions against the layouts, alignment against what the heuristic was promised, outputs
// that overlap an input or each other (a race on a GPU), and attributes or modes it does not
// model, which fail with a message on stderr rather than being silently ignored.
// What it does not model: the tensor cores' summation order and rounding, split-K, workspace
// use, and algorithms other than one that needs no workspace.
#include <cublasLt.h>
#include <cublas_v2.h>

#include <algorithm>
#include <cinttypes>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

// The handles' opaque types are only declared by the headers; these are their definitions here.
struct cublasContext {
  cudaStream_t stream = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

struct cublasLtContext {
  int unused = 0;
};

namespace {

// ---- descriptors ----------------------------------------------------------------------------

struct Layout {
  cudaDataType type = CUDA_R_32F;
  uint64_t rows = 0, cols = 0;
  int64_t ld = 0;
  int32_t batch = 1;
  int64_t stride = 0;  // elements between consecutive matrices of a batch
};

struct MatmulDesc {
  cublasOperation_t trans_a = CUBLAS_OP_N, trans_b = CUBLAS_OP_N;
};

// Operands in the order of the MIN_ALIGNMENT attributes and of the heuristic's algorithm.
enum Operand { kA, kB, kC, kD, kOperands };
constexpr const char* kOperandNames[kOperands] = {"A", "B", "C", "D"};

struct Preference {
  uint64_t max_workspace = 0;
  uint32_t reduction_mask = CUBLASLT_REDUCTION_SCHEME_MASK;
  uint32_t alignment[kOperands] = {256, 256, 256, 256};  // the library's defaults
};

// The descriptor handles point to the headers' fixed-size opaque structs; these descriptors are
// allocated separately and only ever accessed through their own type.
Layout* get(cublasLtMatrixLayout_t p) {
  return reinterpret_cast<Layout*>(p);
}
MatmulDesc* get(cublasLtMatmulDesc_t p) {
  return reinterpret_cast<MatmulDesc*>(p);
}
Preference* get(cublasLtMatmulPreference_t p) {
  return reinterpret_cast<Preference*>(p);
}

// The algorithm the heuristic returns records what it was chosen for, so that cublasLtMatmul can
// check that the operands it is given keep the promises made to the heuristic.
constexpr uint64_t kAlgoTag = 0x66616b65616c676full;  // "fakealgo"
enum AlgoWord { kTag, kAlignmentA, kTypes = kAlignmentA + kOperands };

[[gnu::format(printf, 2, 3)]] cublasStatus_t fail(cublasStatus_t status, const char* format, ...) {
  std::va_list args;
  va_start(args, format);
  std::fputs("fake cuBLAS: ", stderr);
  std::vfprintf(stderr, format, args);
  std::fputc('\n', stderr);
  va_end(args);
  return status;
}

// ---- element types --------------------------------------------------------------------------

int64_t element_size(cudaDataType type) {
  switch (type) {
    case CUDA_R_32F:
      return 4;
    case CUDA_R_16BF:
    case CUDA_R_16F:
      return 2;
    default:
      return 0;  // not modelled
  }
}

const char* type_name(cudaDataType type) {
  switch (type) {
    case CUDA_R_32F:
      return "f32";
    case CUDA_R_16BF:
      return "bf16";
    case CUDA_R_16F:
      return "f16";
    default:
      return "an unmodelled type";
  }
}

// The combinations the library supports with CUBLAS_COMPUTE_32F and these types: A and B alike,
// C/D in their type or, for 16-bit inputs, f32.
bool supported_types(cudaDataType a, cudaDataType b, cudaDataType c) {
  if (a != b) return false;
  if (a == CUDA_R_32F) return c == CUDA_R_32F;
  if (a == CUDA_R_16BF || a == CUDA_R_16F) return c == a || c == CUDA_R_32F;
  return false;
}

uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Conversions written out bit by bit rather than taken from cuda_bf16.h/cuda_fp16.h, so that the
// tests, which use those headers, compare two independent roundings.
uint16_t to_bf16(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
  // Adding just under half a unit, plus the kept bit's parity, rounds to nearest with ties to
  // even; a carry out of the mantissa steps the exponent (up to infinity), as it should.
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

float from_bf16(uint16_t h) {
  return bits_float(static_cast<uint32_t>(h) << 16);
}

uint16_t to_f16(float f) {
  const uint32_t u = float_bits(f);
  const auto sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t magnitude = u & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (magnitude >= 0x477ff000u)
    return static_cast<uint16_t>(sign | 0x7c00u);  // from 65520 (half-way past 65504): inf
  // Keep `shift` fewer bits of the 24-bit significand, to nearest with ties to even.
  auto round_shift = [](uint32_t value, int shift) {
    const uint32_t kept = value >> shift, rest = value & ((1u << shift) - 1),
                   half = 1u << (shift - 1);
    return rest > half || (rest == half && (kept & 1u)) ? kept + 1 : kept;
  };
  if (magnitude < 0x38800000u) {  // below 2^-14: a subnormal half (units of 2^-24) or zero
    if (magnitude <= 0x33000000u) return sign;  // at most 2^-25, half a unit: to even, zero
    const int exponent = static_cast<int>(magnitude >> 23);
    const uint32_t significand = (magnitude & 0x7fffffu) | 0x800000u;
    return static_cast<uint16_t>(sign | round_shift(significand, 126 - exponent));
  }
  // Normal: rebias the exponent (127 -> 15) and drop 13 mantissa bits; a carry is a valid step.
  return static_cast<uint16_t>(sign | round_shift(magnitude - 0x38000000u, 13));
}

float from_f16(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa units of 2^-24, exact in f32
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return sign != 0 ? -magnitude : magnitude;
  }
  if (exponent == 31) return bits_float(sign | 0x7f800000u | (mantissa << 13));
  return bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

float load(cudaDataType type, const void* base, int64_t index) {
  if (type == CUDA_R_32F) {
    float f;
    std::memcpy(&f, static_cast<const char*>(base) + index * 4, sizeof(f));
    return f;
  }
  uint16_t h;
  std::memcpy(&h, static_cast<const char*>(base) + index * 2, sizeof(h));
  return type == CUDA_R_16BF ? from_bf16(h) : from_f16(h);
}

void store(cudaDataType type, void* base, int64_t index, float value) {
  if (type == CUDA_R_32F) {
    std::memcpy(static_cast<char*>(base) + index * 4, &value, sizeof(value));
    return;
  }
  const uint16_t h = type == CUDA_R_16BF ? to_bf16(value) : to_f16(value);
  std::memcpy(static_cast<char*>(base) + index * 2, &h, sizeof(h));
}

// ---- the product ----------------------------------------------------------------------------

// One operand as stored: a column-major rows x cols matrix per batch entry.
struct Matrix {
  const char* name = "";
  cudaDataType type = CUDA_R_32F;
  const void* data = nullptr;
  int64_t rows = 0, cols = 0, ld = 0, stride = 0;
  bool trans = false;  // A and B only: op(X) = X^T

  int64_t size() const { return element_size(type); }
  // Element (r, c) of the stored matrix of batch entry b.
  int64_t index(int64_t b, int64_t r, int64_t c) const { return b * stride + c * ld + r; }
  // Element (r, c) of op(X).
  int64_t op_index(int64_t b, int64_t r, int64_t c) const {
    return trans ? index(b, c, r) : index(b, r, c);
  }
};

struct Problem {
  int64_t m = 0, n = 0, k = 0, batch = 1;
  float alpha = 1, beta = 0;
  Matrix a, b, c, d;  // d.data is the output (writable by the caller's contract)

  bool reads_ab() const { return alpha != 0 && k > 0; }
  bool reads_c() const { return beta != 0; }
};

// Output columns summed at once for one row of op(A): their dot products are independent, so
// the compiler keeps them in vector registers, while each one still adds its k products in
// order (the bits of one column at a time, many times faster than one latency-bound sum).
constexpr int64_t kColumnsAtOnce = 16;

void multiply(const Problem& p) {
  const bool product = p.reads_ab();
  // op(A) by rows and op(B) by rows, in f32 (exact for every input type); op(B)'s rows padded
  // with zeros to whole blocks of columns.
  const int64_t n_padded = (p.n + kColumnsAtOnce - 1) / kColumnsAtOnce * kColumnsAtOnce;
  std::vector<float> a_rows(product ? static_cast<size_t>(p.m * p.k) : 0);
  std::vector<float> b_rows(product ? static_cast<size_t>(p.k * n_padded) : 0, 0.0f);
  void* const d = const_cast<void*>(p.d.data);
  for (int64_t b = 0; b < p.batch; ++b) {
    if (product && (b == 0 || p.a.stride != 0)) {
      for (int64_t i = 0; i < p.m; ++i)
        for (int64_t l = 0; l < p.k; ++l)
          a_rows[i * p.k + l] = load(p.a.type, p.a.data, p.a.op_index(b, i, l));
    }
    if (product && (b == 0 || p.b.stride != 0)) {
      for (int64_t l = 0; l < p.k; ++l)
        for (int64_t j = 0; j < p.n; ++j)
          b_rows[l * n_padded + j] = load(p.b.type, p.b.data, p.b.op_index(b, l, j));
    }
    // A block of op(B)'s columns stays in cache while every row of op(A) passes it.
    for (int64_t j0 = 0; j0 < p.n; j0 += kColumnsAtOnce) {
      for (int64_t i = 0; i < p.m; ++i) {
        float sums[kColumnsAtOnce] = {};
        if (product) {
          const float* x = &a_rows[i * p.k];
          for (int64_t l = 0; l < p.k; ++l) {
            const float* y = &b_rows[l * n_padded + j0];
            for (int64_t c = 0; c < kColumnsAtOnce; ++c) sums[c] += x[l] * y[c];
          }
        }
        for (int64_t j = j0; j < std::min(p.n, j0 + kColumnsAtOnce); ++j) {
          float value = product ? p.alpha * sums[j - j0] : 0.0f;
          if (p.reads_c()) {
            const float scaled_c = p.beta * load(p.c.type, p.c.data, p.c.index(b, i, j));
            value = product ? value + scaled_c : scaled_c;
          }
          store(p.d.type, d, p.d.index(b, i, j), value);
        }
      }
    }
  }
}

// ---- checks of the operands' memory ---------------------------------------------------------

// Byte offsets (from the matrix's pointer) of the first and one past the last byte it covers.
std::pair<int64_t, int64_t> extent(const Matrix& x, int64_t batch) {
  const int64_t one = (x.cols - 1) * x.ld + x.rows;  // elements spanned by one matrix
  const int64_t last = (batch - 1) * x.stride;
  return {std::min<int64_t>(0, last) * x.size(), (std::max<int64_t>(0, last) + one) * x.size()};
}

std::vector<uintptr_t> element_addresses(const Matrix& x, int64_t batch) {
  std::vector<uintptr_t> addresses;
  addresses.reserve(static_cast<size_t>(batch * x.rows * x.cols));
  const auto base = reinterpret_cast<uintptr_t>(x.data);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t c = 0; c < x.cols; ++c)
      for (int64_t r = 0; r < x.rows; ++r)
        addresses.push_back(base + static_cast<uintptr_t>(x.index(b, r, c) * x.size()));
  std::sort(addresses.begin(), addresses.end());
  return addresses;
}

// On a GPU the output's elements are written by many threads at once: two batch entries (or two
// columns) writing one element race, and so does an input that shares memory with the output.
cublasStatus_t check_output_memory(const char* call, const Problem& p,
                                   const std::vector<const Matrix*>& inputs) {
  const Matrix& d = p.d;
  const auto [d_begin, d_end] = extent(d, p.batch);
  const auto d_base = reinterpret_cast<intptr_t>(d.data);
  std::vector<uintptr_t> written;
  const int64_t one = (d.cols - 1) * d.ld + d.rows;
  const int64_t stride = d.stride < 0 ? -d.stride : d.stride;
  if (p.batch > 1 && stride < one) {
    written = element_addresses(d, p.batch);
    if (std::adjacent_find(written.begin(), written.end()) != written.end())
      return fail(CUBLAS_STATUS_INVALID_VALUE,
                  "%s: the %" PRId64 " output matrices of %s (%" PRId64 " x %" PRId64
                  ", ld %" PRId64 ", batch stride %" PRId64
                  ") share elements, which threads of a GPU would write at once",
                  call, p.batch, d.name, d.rows, d.cols, d.ld, d.stride);
  }
  for (const Matrix* x : inputs) {
    const auto [x_begin, x_end] = extent(*x, p.batch);
    const auto x_base = reinterpret_cast<intptr_t>(x->data);
    if (x_base + x_end <= d_base + d_begin || d_base + d_end <= x_base + x_begin) continue;
    if (written.empty()) written = element_addresses(d, p.batch);
    for (const uintptr_t address : element_addresses(*x, p.batch)) {
      // The first output element ending after this input element starts.
      auto it = std::lower_bound(written.begin(), written.end(),
                                 address - static_cast<uintptr_t>(d.size()) + 1);
      if (it != written.end() && *it < address + static_cast<uintptr_t>(x->size()))
        return fail(CUBLAS_STATUS_INVALID_VALUE,
                    "%s: %s shares memory with the output %s: on a GPU, threads would read it "
                    "while others write it",
                    call, x->name, d.name);
    }
  }
  return CUBLAS_STATUS_SUCCESS;
}

// The largest power of two (up to 256) dividing every address of an operand's matrices.
uint32_t actual_alignment(const Matrix& x, int64_t batch) {
  auto address = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(x.data));
  address |= static_cast<uint64_t>(x.ld * x.size());
  if (batch > 1) address |= static_cast<uint64_t>(x.stride * x.size());
  uint32_t alignment = 1;
  while (alignment < 256 && address % (2 * alignment) == 0) alignment *= 2;
  return alignment;
}

cublasStatus_t check_element_alignment(const char* call, const Matrix& x) {
  if (reinterpret_cast<uintptr_t>(x.data) % static_cast<uintptr_t>(x.size()) == 0)
    return CUBLAS_STATUS_SUCCESS;
  return fail(CUBLAS_STATUS_INVALID_VALUE, "%s: %s at %p is not aligned to its %s elements", call,
              x.name, x.data, type_name(x.type));
}

// ---- cuBLASLt problem ----------------------------------------------------------------------

// The product described by a matmul descriptor and four layouts, checked for consistency.
cublasStatus_t describe(const char* call, const MatmulDesc* desc, const Layout* a, const Layout* b,
                        const Layout* c, const Layout* d, Problem* p) {
  if (desc == nullptr || a == nullptr || b == nullptr || c == nullptr || d == nullptr)
    return fail(CUBLAS_STATUS_INVALID_VALUE, "%s: a descriptor or layout is null", call);
  if (!supported_types(a->type, b->type, d->type) || c->type != d->type)
    return fail(CUBLAS_STATUS_NOT_SUPPORTED,
                "%s: A %s, B %s, C %s, D %s with CUBLAS_COMPUTE_32F is not a supported "
                "combination",
                call, type_name(a->type), type_name(b->type), type_name(c->type),
                type_name(d->type));
  const Layout* layouts[kOperands] = {a, b, c, d};
  for (int i = 0; i < kOperands; ++i) {
    const Layout& l = *layouts[i];
    constexpr auto kMax = static_cast<uint64_t>(std::numeric_limits<int32_t>::max());
    if (l.rows > kMax || l.cols > kMax)
      return fail(CUBLAS_STATUS_NOT_SUPPORTED,
                  "%s: %s is %" PRIu64 " x %" PRIu64 ", beyond the int32 sizes modelled", call,
                  kOperandNames[i], l.rows, l.cols);
    if (l.ld < std::max<int64_t>(1, static_cast<int64_t>(l.rows)))
      return fail(CUBLAS_STATUS_INVALID_VALUE,
                  "%s: %s has ld %" PRId64 " below its %" PRIu64 " rows (column-major)", call,
                  kOperandNames[i], l.ld, l.rows);
    if (l.batch != d->batch)
      return fail(CUBLAS_STATUS_INVALID_VALUE,
                  "%s: %s has batch count %d but D has %d; every layout needs the same", call,
                  kOperandNames[i], l.batch, d->batch);
  }
  const bool ta = desc->trans_a == CUBLAS_OP_T, tb = desc->trans_b == CUBLAS_OP_T;
  const auto rows = [](const Layout* l, bool t) {
    return static_cast<int64_t>(t ? l->cols : l->rows);
  };
  const auto cols = [](const Layout* l, bool t) {
    return static_cast<int64_t>(t ? l->rows : l->cols);
  };
  p->m = static_cast<int64_t>(d->rows);
  p->n = static_cast<int64_t>(d->cols);
  p->k = cols(a, ta);
  p->batch = d->batch;
  if (c->rows != d->rows || c->cols != d->cols || rows(a, ta) != p->m || rows(b, tb) != p->k ||
      cols(b, tb) != p->n)
    return fail(CUBLAS_STATUS_INVALID_VALUE,
                "%s: op(A) is %" PRId64 " x %" PRId64 " (transa %c), op(B) is %" PRId64
                " x %" PRId64 " (transb %c), C is %" PRIu64 " x %" PRIu64 " and D is %" PRIu64
                " x %" PRIu64 "; op(A) op(B) needs op(A) m x k, op(B) k x n, C and D m x n",
                call, rows(a, ta), cols(a, ta), ta ? 'T' : 'N', rows(b, tb), cols(b, tb),
                tb ? 'T' : 'N', c->rows, c->cols, d->rows, d->cols);
  const auto matrix = [](const char* name, const Layout* l, bool t) {
    Matrix x;
    x.name = name;
    x.type = l->type;
    x.rows = static_cast<int64_t>(l->rows);
    x.cols = static_cast<int64_t>(l->cols);
    x.ld = l->ld;
    x.stride = l->batch > 1 ? l->stride : 0;
    x.trans = t;
    return x;
  };
  p->a = matrix("A", a, ta);
  p->b = matrix("B", b, tb);
  p->c = matrix("C", c, false);
  p->d = matrix("D", d, false);
  return CUBLAS_STATUS_SUCCESS;
}

bool same_layout(const Layout& x, const Layout& y) {
  return x.type == y.type && x.rows == y.rows && x.cols == y.cols && x.ld == y.ld &&
         x.batch == y.batch && (x.batch == 1 || x.stride == y.stride);
}

uint64_t packed_types(const Problem& p) {
  return static_cast<uint64_t>(p.a.type) | static_cast<uint64_t>(p.b.type) << 16 |
         static_cast<uint64_t>(p.c.type) << 32 | static_cast<uint64_t>(p.d.type) << 48;
}

// Reads an attribute value of exactly the size the library stores it in.
template <typename T>
cublasStatus_t read_attribute(const char* call, int attr, const void* buf, size_t size, T* out) {
  if (buf == nullptr || size != sizeof(T))
    return fail(CUBLAS_STATUS_INVALID_VALUE, "%s: attribute %d takes %zu bytes, got %zu%s", call,
                attr, sizeof(T), size, buf == nullptr ? " at a null pointer" : "");
  std::memcpy(out, buf, sizeof(T));
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t unmodelled(const char* call, int attr, const char* what) {
  return fail(CUBLAS_STATUS_NOT_SUPPORTED, "%s: attribute %d: %s is not modelled", call, attr,
              what);
}

}  // namespace

// ---- cuBLASLt -------------------------------------------------------------------------------

cublasStatus_t cublasLtCreate(cublasLtHandle_t* lightHandle) {
  if (lightHandle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *lightHandle = new cublasLtContext;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtDestroy(cublasLtHandle_t lightHandle) {
  if (lightHandle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete lightHandle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* matLayout, cudaDataType type,
                                          uint64_t rows, uint64_t cols, int64_t ld) {
  if (matLayout == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  if (element_size(type) == 0)
    return fail(CUBLAS_STATUS_NOT_SUPPORTED, "cublasLtMatrixLayoutCreate: data type %d",
                static_cast<int>(type));
  auto* layout = new Layout;
  layout->type = type;
  layout->rows = rows;
  layout->cols = cols;
  layout->ld = ld;
  *matLayout = reinterpret_cast<cublasLtMatrixLayout_t>(layout);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t matLayout) {
  delete get(matLayout);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t matLayout,
                                                cublasLtMatrixLayoutAttribute_t attr,
                                                const void* buf, size_t sizeInBytes) {
  constexpr const char* kCall = "cublasLtMatrixLayoutSetAttribute";
  if (matLayout == nullptr) return fail(CUBLAS_STATUS_INVALID_VALUE, "%s: null layout", kCall);
  Layout& l = *get(matLayout);
  const int id = static_cast<int>(attr);
  cublasStatus_t s = CUBLAS_STATUS_SUCCESS;
  switch (attr) {
    case CUBLASLT_MATRIX_LAYOUT_TYPE: {
      uint32_t type = 0;
      if ((s = read_attribute(kCall, id, buf, sizeInBytes, &type)) != CUBLAS_STATUS_SUCCESS)
        return s;
      if (element_size(static_cast<cudaDataType>(type)) == 0)
        return unmodelled(kCall, id, "this data type");
      l.type = static_cast<cudaDataType>(type);
      return s;
    }
    case CUBLASLT_MATRIX_LAYOUT_ORDER: {
      int32_t order = 0;
      if ((s = read_attribute(kCall, id, buf, sizeInBytes, &order)) != CUBLAS_STATUS_SUCCESS)
        return s;
      return order == CUBLASLT_ORDER_COL ? s : unmodelled(kCall, id, "an order other than COL");
    }
    case CUBLASLT_MATRIX_LAYOUT_ROWS:
      return read_attribute(kCall, id, buf, sizeInBytes, &l.rows);
    case CUBLASLT_MATRIX_LAYOUT_COLS:
      return read_attribute(kCall, id, buf, sizeInBytes, &l.cols);
    case CUBLASLT_MATRIX_LAYOUT_LD:
      return read_attribute(kCall, id, buf, sizeInBytes, &l.ld);
    case CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT: {
      int32_t batch = 0;
      if ((s = read_attribute(kCall, id, buf, sizeInBytes, &batch)) != CUBLAS_STATUS_SUCCESS)
        return s;
      if (batch < 1) return fail(CUBLAS_STATUS_INVALID_VALUE, "%s: batch count %d", kCall, batch);
      l.batch = batch;
      return s;
    }
    case CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET:
      return read_attribute(kCall, id, buf, sizeInBytes, &l.stride);
    case CUBLASLT_MATRIX_LAYOUT_PLANE_OFFSET: {
      int64_t offset = 0;
      if ((s = read_attribute(kCall, id, buf, sizeInBytes, &offset)) != CUBLAS_STATUS_SUCCESS)
        return s;
      return offset == 0 ? s : unmodelled(kCall, id, "a planar-complex layout");
    }
    default:
      return unmodelled(kCall, id, "this layout attribute");
  }
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* matmulDesc,
                                        cublasComputeType_t computeType, cudaDataType_t scaleType) {
  if (matmulDesc == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  // Only fp32 compute with fp32 scalars is modelled: TF32 or other fast modes would change the
  // results that the emulated products are compared against.
  if (computeType != CUBLAS_COMPUTE_32F || scaleType != CUDA_R_32F)
    return fail(CUBLAS_STATUS_NOT_SUPPORTED,
                "cublasLtMatmulDescCreate: compute type %d with scale type %d is not modelled "
                "(only CUBLAS_COMPUTE_32F with CUDA_R_32F)",
                static_cast<int>(computeType), static_cast<int>(scaleType));
  *matmulDesc = reinterpret_cast<cublasLtMatmulDesc_t>(new MatmulDesc);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t matmulDesc) {
  delete get(matmulDesc);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t matmulDesc,
                                              cublasLtMatmulDescAttributes_t attr, const void* buf,
                                              size_t sizeInBytes) {
  constexpr const char* kCall = "cublasLtMatmulDescSetAttribute";
  if (matmulDesc == nullptr) return fail(CUBLAS_STATUS_INVALID_VALUE, "%s: null descriptor", kCall);
  MatmulDesc& desc = *get(matmulDesc);
  const int id = static_cast<int>(attr);
  cublasStatus_t s = CUBLAS_STATUS_SUCCESS;
  int32_t value = 0;
  switch (attr) {
    // Attributes that may be set, but only to the one value modelled.
    case CUBLASLT_MATMUL_DESC_COMPUTE_TYPE:
      if ((s = read_attribute(kCall, id, buf, sizeInBytes, &value)) != CUBLAS_STATUS_SUCCESS)
        return s;
      return value == CUBLAS_COMPUTE_32F ? s : unmodelled(kCall, id, "a compute type but 32F");
    case CUBLASLT_MATMUL_DESC_SCALE_TYPE:
      if ((s = read_attribute(kCall, id, buf, sizeInBytes, &value)) != CUBLAS_STATUS_SUCCESS)
        return s;
      return value == CUDA_R_32F ? s : unmodelled(kCall, id, "a scale type but CUDA_R_32F");
    case CUBLASLT_MATMUL_DESC_POINTER_MODE:
      if ((s = read_attribute(kCall, id, buf, sizeInBytes, &value)) != CUBLAS_STATUS_SUCCESS)
        return s;
      return value == CUBLASLT_POINTER_MODE_HOST ? s : unmodelled(kCall, id, "device scalars");
    case CUBLASLT_MATMUL_DESC_TRANSC:
      if ((s = read_attribute(kCall, id, buf, sizeInBytes, &value)) != CUBLAS_STATUS_SUCCESS)
        return s;
      return value == CUBLAS_OP_N ? s : unmodelled(kCall, id, "a transposed C");
    case CUBLASLT_MATMUL_DESC_EPILOGUE: {
      uint32_t epilogue = 0;
      if ((s = read_attribute(kCall, id, buf, sizeInBytes, &epilogue)) != CUBLAS_STATUS_SUCCESS)
        return s;
      return epilogue == CUBLASLT_EPILOGUE_DEFAULT ? s : unmodelled(kCall, id, "an epilogue");
    }
    case CUBLASLT_MATMUL_DESC_TRANSA:
    case CUBLASLT_MATMUL_DESC_TRANSB: {
      if ((s = read_attribute(kCall, id, buf, sizeInBytes, &value)) != CUBLAS_STATUS_SUCCESS)
        return s;
      // CUBLAS_OP_C means T for real types, but nothing here needs it: refused so that its
      // first use is looked at.
      if (value != CUBLAS_OP_N && value != CUBLAS_OP_T)
        return unmodelled(kCall, id, "an operation other than CUBLAS_OP_N or CUBLAS_OP_T");
      (attr == CUBLASLT_MATMUL_DESC_TRANSA ? desc.trans_a : desc.trans_b) =
          static_cast<cublasOperation_t>(value);
      return s;
    }
    default:
      return unmodelled(kCall, id, "this matmul attribute");
  }
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
  if (pref == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *pref = reinterpret_cast<cublasLtMatmulPreference_t>(new Preference);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  delete get(pref);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr,
                                                    const void* buf, size_t sizeInBytes) {
  constexpr const char* kCall = "cublasLtMatmulPreferenceSetAttribute";
  if (pref == nullptr) return fail(CUBLAS_STATUS_INVALID_VALUE, "%s: null preference", kCall);
  Preference& p = *get(pref);
  const int id = static_cast<int>(attr);
  switch (attr) {
    case CUBLASLT_MATMUL_PREF_SEARCH_MODE: {
      uint32_t mode = 0;
      const cublasStatus_t s = read_attribute(kCall, id, buf, sizeInBytes, &mode);
      if (s != CUBLAS_STATUS_SUCCESS) return s;
      return mode == CUBLASLT_SEARCH_BEST_FIT ? s : unmodelled(kCall, id, "a search mode");
    }
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES:
      return read_attribute(kCall, id, buf, sizeInBytes, &p.max_workspace);
    // The one algorithm has no split-K, so every mask admits it; the value is kept, not used.
    case CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK:
      return read_attribute(kCall, id, buf, sizeInBytes, &p.reduction_mask);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES:
      return read_attribute(kCall, id, buf, sizeInBytes, &p.alignment[kA]);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES:
      return read_attribute(kCall, id, buf, sizeInBytes, &p.alignment[kB]);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES:
      return read_attribute(kCall, id, buf, sizeInBytes, &p.alignment[kC]);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES:
      return read_attribute(kCall, id, buf, sizeInBytes, &p.alignment[kD]);
    default:
      return unmodelled(kCall, id, "this preference attribute");
  }
}

// One algorithm, which needs no workspace, for every valid problem, except where an operand of
// 16-bit elements is promised less than 16-byte alignment (or any operand less than its element
// size). The real library's tensor-core kernels load 16-bit operands 16 bytes at a time, and for
// some such misaligned operands it has no algorithm at all; refusing all of them here (with
// CUBLAS_STATUS_NOT_SUPPORTED and no result, as the library does when it finds none) makes
// callers take their fallback path whenever it could be needed on a GPU.
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(
    cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t operationDesc, cublasLtMatrixLayout_t Adesc,
    cublasLtMatrixLayout_t Bdesc, cublasLtMatrixLayout_t Cdesc, cublasLtMatrixLayout_t Ddesc,
    cublasLtMatmulPreference_t preference, int requestedAlgoCount,
    cublasLtMatmulHeuristicResult_t heuristicResultsArray[], int* returnAlgoCount) {
  constexpr const char* kCall = "cublasLtMatmulAlgoGetHeuristic";
  if (lightHandle == nullptr) return fail(CUBLAS_STATUS_NOT_INITIALIZED, "%s: null handle", kCall);
  if (returnAlgoCount == nullptr || heuristicResultsArray == nullptr || preference == nullptr ||
      requestedAlgoCount <= 0)
    return fail(CUBLAS_STATUS_INVALID_VALUE,
                "%s: needs a preference, a result array and a requested count above 0", kCall);
  *returnAlgoCount = 0;
  Problem p;
  const cublasStatus_t s =
      describe(kCall, get(operationDesc), get(Adesc), get(Bdesc), get(Cdesc), get(Ddesc), &p);
  if (s != CUBLAS_STATUS_SUCCESS) return s;
  const Preference& pref = *get(preference);
  const Matrix* operands[kOperands] = {&p.a, &p.b, &p.c, &p.d};
  cublasLtMatmulHeuristicResult_t result;
  std::memset(&result, 0, sizeof(result));
  result.algo.data[kTag] = kAlgoTag;
  result.algo.data[kTypes] = packed_types(p);
  for (int i = 0; i < kOperands; ++i) {
    // Only the power of two in the promise counts: an address that is a multiple of 24 bytes is
    // only known to be a multiple of 8.
    const uint32_t promised = pref.alignment[i] & (~pref.alignment[i] + 1);
    const auto size = static_cast<uint32_t>(operands[i]->size());
    if (promised < size || (size == 2 && promised < 16)) return CUBLAS_STATUS_NOT_SUPPORTED;
    result.algo.data[kAlignmentA + i] = promised;
  }
  result.workspaceSize = 0;
  result.state = CUBLAS_STATUS_SUCCESS;
  result.wavesCount = 1.0f;
  heuristicResultsArray[0] = result;
  *returnAlgoCount = 1;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t computeDesc,
                              const void* alpha, const void* A, cublasLtMatrixLayout_t Adesc,
                              const void* B, cublasLtMatrixLayout_t Bdesc, const void* beta,
                              const void* C, cublasLtMatrixLayout_t Cdesc, void* D,
                              cublasLtMatrixLayout_t Ddesc, const cublasLtMatmulAlgo_t* algo,
                              void* workspace, size_t workspaceSizeInBytes, cudaStream_t stream) {
  constexpr const char* kCall = "cublasLtMatmul";
  if (lightHandle == nullptr) return fail(CUBLAS_STATUS_NOT_INITIALIZED, "%s: null handle", kCall);
  Problem p;
  cublasStatus_t s =
      describe(kCall, get(computeDesc), get(Adesc), get(Bdesc), get(Cdesc), get(Ddesc), &p);
  if (s != CUBLAS_STATUS_SUCCESS) return s;
  if (alpha == nullptr || beta == nullptr)
    return fail(CUBLAS_STATUS_INVALID_VALUE, "%s: alpha and beta are needed", kCall);
  std::memcpy(&p.alpha, alpha, sizeof(float));
  std::memcpy(&p.beta, beta, sizeof(float));
  p.a.data = A;
  p.b.data = B;
  p.c.data = C;
  p.d.data = D;
  if (workspace == nullptr && workspaceSizeInBytes > 0)
    return fail(CUBLAS_STATUS_INVALID_VALUE, "%s: %zu bytes of workspace at a null pointer", kCall,
                workspaceSizeInBytes);
  if (p.m == 0 || p.n == 0) return CUBLAS_STATUS_SUCCESS;

  // In place (C == D), one layout must describe both, as the library requires.
  if (p.reads_c() && C == D && !same_layout(*get(Cdesc), *get(Ddesc)))
    return fail(CUBLAS_STATUS_INVALID_VALUE,
                "%s: C and D are the same memory with different layouts", kCall);
  std::vector<const Matrix*> read;
  if (p.reads_ab()) read = {&p.a, &p.b};
  if (p.reads_c()) read.push_back(&p.c);
  for (const Matrix* x : read)
    if (x->data == nullptr)
      return fail(CUBLAS_STATUS_INVALID_VALUE, "%s: %s is read but null", kCall, x->name);
  if (D == nullptr) return fail(CUBLAS_STATUS_INVALID_VALUE, "%s: D is null", kCall);
  read.push_back(&p.d);
  for (const Matrix* x : read)
    if ((s = check_element_alignment(kCall, *x)) != CUBLAS_STATUS_SUCCESS) return s;

  if (algo != nullptr) {  // without one, the library chooses for the operands as they are
    if (algo->data[kTag] != kAlgoTag)
      return fail(CUBLAS_STATUS_INVALID_VALUE,
                  "%s: the algorithm does not come from cublasLtMatmulAlgoGetHeuristic (the only "
                  "source modelled)",
                  kCall);
    if (algo->data[kTypes] != packed_types(p))
      return fail(CUBLAS_STATUS_INVALID_VALUE, "%s: the algorithm was chosen for other data types",
                  kCall);
    const Matrix* operands[kOperands] = {&p.a, &p.b, &p.c, &p.d};
    for (int i = 0; i < kOperands; ++i) {
      if (i == kC && !p.reads_c()) continue;
      if (i <= kB && !p.reads_ab()) continue;
      const uint64_t promised = algo->data[kAlignmentA + i];
      const uint32_t actual = actual_alignment(*operands[i], p.batch);
      if (actual < promised)
        return fail(CUBLAS_STATUS_INVALID_VALUE,
                    "%s: %s (at %p, ld %" PRId64 ", batch stride %" PRId64
                    ") is %u-byte aligned, but its algorithm was chosen for %" PRIu64 " bytes",
                    kCall, operands[i]->name, operands[i]->data, operands[i]->ld,
                    operands[i]->stride, actual, promised);
    }
  }

  read.pop_back();
  if (p.reads_c() && C == D) read.pop_back();  // in place: element (i, j) is read, then written
  if ((s = check_output_memory(kCall, p, read)) != CUBLAS_STATUS_SUCCESS) return s;
  multiply(p);
  return CUBLAS_STATUS_SUCCESS;
}

// ---- cuBLAS ---------------------------------------------------------------------------------

cublasStatus_t cublasCreate(cublasHandle_t* handle) {
  if (handle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *handle = new cublasContext;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy(cublasHandle_t handle) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t streamId) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->stream = streamId;
  // The library goes back to its default workspace pool whenever the stream is set.
  handle->workspace = nullptr;
  handle->workspace_bytes = 0;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace(cublasHandle_t handle, void* workspace,
                                  size_t workspaceSizeInBytes) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  // The library requires a workspace aligned to 256 bytes, as cudaMalloc's blocks are.
  if (reinterpret_cast<uintptr_t>(workspace) % 256 != 0)
    return fail(CUBLAS_STATUS_INVALID_VALUE,
                "cublasSetWorkspace: workspace at %p is not 256-byte aligned", workspace);
  if (workspace == nullptr && workspaceSizeInBytes > 0)
    return fail(CUBLAS_STATUS_INVALID_VALUE,
                "cublasSetWorkspace: %zu bytes of workspace at a null pointer",
                workspaceSizeInBytes);
  handle->workspace = workspace;
  handle->workspace_bytes = workspaceSizeInBytes;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t handle, cublasOperation_t transa,
                                          cublasOperation_t transb, int m, int n, int k,
                                          const void* alpha, const void* A, cudaDataType Atype,
                                          int lda, long long int strideA, const void* B,
                                          cudaDataType Btype, int ldb, long long int strideB,
                                          const void* beta, void* C, cudaDataType Ctype, int ldc,
                                          long long int strideC, int batchCount,
                                          cublasComputeType_t computeType, cublasGemmAlgo_t algo) {
  constexpr const char* kCall = "cublasGemmStridedBatchedEx";
  if (handle == nullptr) return fail(CUBLAS_STATUS_NOT_INITIALIZED, "%s: null handle", kCall);
  if (computeType != CUBLAS_COMPUTE_32F)
    return fail(CUBLAS_STATUS_NOT_SUPPORTED,
                "%s: compute type %d is not modelled (only CUBLAS_COMPUTE_32F)", kCall,
                static_cast<int>(computeType));
  if (algo != CUBLAS_GEMM_DEFAULT && algo != CUBLAS_GEMM_DEFAULT_TENSOR_OP)
    return fail(CUBLAS_STATUS_NOT_SUPPORTED, "%s: algorithm %d is not modelled", kCall,
                static_cast<int>(algo));
  if ((transa != CUBLAS_OP_N && transa != CUBLAS_OP_T) ||
      (transb != CUBLAS_OP_N && transb != CUBLAS_OP_T))
    return fail(CUBLAS_STATUS_NOT_SUPPORTED,
                "%s: operations other than CUBLAS_OP_N and CUBLAS_OP_T are not modelled", kCall);
  if (!supported_types(Atype, Btype, Ctype))
    return fail(CUBLAS_STATUS_NOT_SUPPORTED,
                "%s: A %s, B %s, C %s with CUBLAS_COMPUTE_32F is not a supported combination",
                kCall, type_name(Atype), type_name(Btype), type_name(Ctype));
  const bool ta = transa == CUBLAS_OP_T, tb = transb == CUBLAS_OP_T;
  if (m < 0 || n < 0 || k < 0 || batchCount < 0)
    return fail(CUBLAS_STATUS_INVALID_VALUE, "%s: m %d, n %d, k %d, batch count %d", kCall, m, n, k,
                batchCount);
  if (lda < std::max(1, ta ? k : m) || ldb < std::max(1, tb ? n : k) || ldc < std::max(1, m))
    return fail(CUBLAS_STATUS_INVALID_VALUE,
                "%s: lda %d, ldb %d, ldc %d below the rows of A (%d), B (%d), C (%d)", kCall, lda,
                ldb, ldc, ta ? k : m, tb ? n : k, m);
  if (alpha == nullptr || beta == nullptr)
    return fail(CUBLAS_STATUS_INVALID_VALUE, "%s: alpha and beta are needed", kCall);
  Problem p;
  p.m = m;
  p.n = n;
  p.k = k;
  p.batch = batchCount;
  std::memcpy(&p.alpha, alpha, sizeof(float));  // host pointer mode, fp32 scalars
  std::memcpy(&p.beta, beta, sizeof(float));
  const auto matrix = [&](const char* name, cudaDataType type, const void* data, int64_t rows,
                          int64_t cols, int ld, long long stride, bool trans) {
    Matrix x;
    x.name = name;
    x.type = type;
    x.data = data;
    x.rows = rows;
    x.cols = cols;
    x.ld = ld;
    x.stride = batchCount > 1 ? stride : 0;
    x.trans = trans;
    return x;
  };
  p.a = matrix("A", Atype, A, ta ? k : m, ta ? m : k, lda, strideA, ta);
  p.b = matrix("B", Btype, B, tb ? n : k, tb ? k : n, ldb, strideB, tb);
  p.c = matrix("C", Ctype, C, m, n, ldc, strideC, false);
  p.d = p.c;
  p.d.name = "C (the output)";
  if (m == 0 || n == 0 || batchCount == 0) return CUBLAS_STATUS_SUCCESS;

  std::vector<const Matrix*> read;
  if (p.reads_ab()) read = {&p.a, &p.b};
  for (const Matrix* x : read)
    if (x->data == nullptr)
      return fail(CUBLAS_STATUS_INVALID_VALUE, "%s: %s is read but null", kCall, x->name);
  if (C == nullptr) return fail(CUBLAS_STATUS_INVALID_VALUE, "%s: C is null", kCall);
  cublasStatus_t s = CUBLAS_STATUS_SUCCESS;
  for (const Matrix* x : {&p.a, &p.b, &p.c})
    if ((x == &p.c || p.reads_ab()) &&
        (s = check_element_alignment(kCall, *x)) != CUBLAS_STATUS_SUCCESS)
      return s;
  if ((s = check_output_memory(kCall, p, read)) != CUBLAS_STATUS_SUCCESS) return s;
  multiply(p);
  return CUBLAS_STATUS_SUCCESS;
}

const char* cublasGetStatusString(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS: the operation completed successfully";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "CUBLAS_STATUS_NOT_INITIALIZED: the library was not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "CUBLAS_STATUS_ALLOC_FAILED: resource allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE: an invalid value was used as an argument";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "CUBLAS_STATUS_ARCH_MISMATCH: the device does not support the operation";
    case CUBLAS_STATUS_MAPPING_ERROR:
      return "CUBLAS_STATUS_MAPPING_ERROR: an access to GPU memory space failed";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "CUBLAS_STATUS_EXECUTION_FAILED: the GPU program failed to execute";
    case CUBLAS_STATUS_INTERNAL_ERROR:
      return "CUBLAS_STATUS_INTERNAL_ERROR: an internal operation failed";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED: the functionality requested is not supported";
    case CUBLAS_STATUS_LICENSE_ERROR:
      return "CUBLAS_STATUS_LICENSE_ERROR: a license error occurred";
    default:
      return "unknown cuBLAS status";
  }
}
