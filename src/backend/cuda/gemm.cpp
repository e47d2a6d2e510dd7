// Matrix products through cuBLASLt.
//
// Row-major C = op(A) op(B) is computed as the column-major product C^T = op(B)^T op(A)^T: a
// row-major matrix is its transpose in column-major order, so cuBLASLt is handed B as its first
// operand and A as its second, with the dimensions m and n swapped and the transposes kept.
// Batches use cuBLASLt's strided-batch layout attributes (stride 0 broadcasts one matrix).
// Compute is fp32 throughout (CUBLAS_COMPUTE_32F: no TF32 for f32 inputs, so results match the
// CPU backend closely); 16-bit inputs run on tensor cores with fp32 accumulation.
//
// cuBLASLt may have no algorithm for operands it is promised little alignment (a 16-bit view
// at an odd element offset, a leading dimension of an odd number of 16-bit elements). Those
// products go through cuBLAS's cublasGemmStridedBatchedEx instead, which accepts any alignment,
// with the same compute type and the same workspace.
#include <cublasLt.h>
#include <cublas_v2.h>

#include <array>
#include <limits>
#include <memory>
#include <type_traits>

#include "cuda_backend.h"
#include "shardtrain/core/error.h"

namespace shardtrain::cuda {

namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;

void check_cublas(cublasStatus_t status, const char* call) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  throw Error(shardtrain::detail::concat("cuBLASLt call ", call,
                                         " failed: ", cublasGetStatusString(status)));
}
#define ST_CUBLAS_CHECK(call) check_cublas((call), #call)

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::F32:
      return CUDA_R_32F;
    case DType::BF16:
      return CUDA_R_16BF;
    case DType::F16:
      return CUDA_R_16F;
    default:
      throw ShapeError(
          shardtrain::detail::concat("gemm needs float operands, got ", dtype_name(t)));
  }
}

// Largest power of two (up to 256) dividing the address of every matrix of an operand (the
// first one, the batch stride and the leading dimension in bytes): cuBLASLt picks kernels by the
// alignment it is promised.
int64_t alignment_of(const void* p, int64_t ld_bytes, int64_t stride_bytes) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  const auto ld = static_cast<uintptr_t>(ld_bytes), stride = static_cast<uintptr_t>(stride_bytes);
  int64_t a = 1;
  while (a < 256) {
    const auto next = static_cast<uintptr_t>(2 * a);
    if (address % next != 0 || ld % next != 0 || stride % next != 0) break;
    a *= 2;
  }
  return a;
}

cublasLtMatrixLayout_t make_layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld,
                                   int64_t batch, int64_t stride) {
  // cuBLASLt counts batches in int32.
  ST_CHECK(batch <= std::numeric_limits<int32_t>::max(), "a batched matrix product of ", batch,
           " matrices is more than cuBLASLt takes (2^31 - 1): lower train.micro_batch");
  cublasLtMatrixLayout_t raw = nullptr;
  ST_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&raw, type, static_cast<uint64_t>(rows),
                                             static_cast<uint64_t>(cols), ld));
  // Owned here until returned: destroyed if setting an attribute fails.
  std::unique_ptr<std::remove_pointer_t<cublasLtMatrixLayout_t>,
                  decltype(&cublasLtMatrixLayoutDestroy)>
      layout(raw, &cublasLtMatrixLayoutDestroy);
  if (batch > 1) {
    const int32_t count = static_cast<int32_t>(batch);
    ST_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
        layout.get(), CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
    ST_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
        layout.get(), CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
  }
  return layout.release();
}

}  // namespace

struct CublasLtGemm::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;
  bool classic = false;  // cuBLASLt had no algorithm: cublasGemmStridedBatchedEx runs it

  ~Plan() {
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (c != nullptr) cublasLtMatrixLayoutDestroy(c);
    if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
  }
};

CublasLtGemm::CublasLtGemm() = default;

CublasLtGemm::~CublasLtGemm() {
  plans_.clear();
  for (auto& [device, h] : handles_) cublasLtDestroy(static_cast<cublasLtHandle_t>(h));
  for (auto& [device, h] : classic_handles_) cublasDestroy(static_cast<cublasHandle_t>(h));
}

void* CublasLtGemm::classic_handle(int device) {
  auto it = classic_handles_.find(device);
  if (it != classic_handles_.end()) return it->second;
  cublasHandle_t h = nullptr;
  ST_CUBLAS_CHECK(cublasCreate(&h));
  classic_handles_[device] = h;
  return h;
}

void* CublasLtGemm::handle(int device) {
  auto it = handles_.find(device);
  if (it != handles_.end()) return it->second;
  cublasLtHandle_t h = nullptr;
  ST_CUBLAS_CHECK(cublasLtCreate(&h));
  handles_[device] = h;
  return h;
}

std::pair<void*, size_t> CublasLtGemm::workspace(int device, cudaStream_t stream) {
  auto key = std::make_pair(device, stream);
  auto it = workspaces_.find(key);
  if (it == workspaces_.end()) {
    DataPtr buffer;
    try {
      buffer = DataPtr(kWorkspaceBytes, Device::cuda(device), MemoryCategory::Workspace);
    } catch (const OutOfMemoryError&) {
      // Under a tight memory cap, run the algorithms that need no workspace.
    }
    it = workspaces_.emplace(key, std::move(buffer)).first;
  }
  return {it->second.get(), it->second.bytes()};
}

void CublasLtGemm::forget_stream(int device, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  workspaces_.erase(std::make_pair(device, stream));
}

void CublasLtGemm::run(int device, cudaStream_t stream, const Problem& p) {
  // Column-major operands: first = B (n x k after op), second = A (k x m after op).
  const cudaDataType_t in = cuda_type(p.in_type), out = cuda_type(p.out_type);
  const int64_t first_rows = p.trans_b ? p.k : p.n, first_cols = p.trans_b ? p.n : p.k;
  const int64_t second_rows = p.trans_a ? p.m : p.k, second_cols = p.trans_a ? p.k : p.m;

  const int64_t in_size = static_cast<int64_t>(dtype_size(p.in_type));
  const int64_t out_size = static_cast<int64_t>(dtype_size(p.out_type));
  const int64_t align_first =
      alignment_of(p.b, first_rows * in_size, p.batch > 1 ? p.stride_b * in_size : 0);
  const int64_t align_second =
      alignment_of(p.a, second_rows * in_size, p.batch > 1 ? p.stride_a * in_size : 0);
  const int64_t align_c =
      alignment_of(p.c, p.n * out_size, p.batch > 1 ? p.stride_c * out_size : 0);

  std::lock_guard<std::mutex> lock(mutex_);
  auto [ws, ws_bytes] = workspace(device, stream);
  const std::vector<int64_t> key = {device,
                                    static_cast<int64_t>(p.in_type),
                                    static_cast<int64_t>(p.out_type),
                                    p.trans_a,
                                    p.trans_b,
                                    p.m,
                                    p.n,
                                    p.k,
                                    p.batch,
                                    p.batch > 1 ? p.stride_a : 0,
                                    p.batch > 1 ? p.stride_b : 0,
                                    p.batch > 1 ? p.stride_c : 0,
                                    align_first,
                                    align_second,
                                    align_c,
                                    static_cast<int64_t>(ws_bytes),
                                    p.beta == 0.0f};
  auto it = plans_.find(key);
  if (it == plans_.end()) {
    auto plan = std::make_unique<Plan>();
    ST_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t op_first = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_second = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    ST_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA,
                                                   &op_first, sizeof(op_first)));
    ST_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB,
                                                   &op_second, sizeof(op_second)));
    plan->a = make_layout(in, first_rows, first_cols, first_rows, p.batch, p.stride_b);
    plan->b = make_layout(in, second_rows, second_cols, second_rows, p.batch, p.stride_a);
    plan->c = make_layout(out, p.n, p.m, p.n, p.batch, p.stride_c);

    // Owned for this block only; released on every path, errors included.
    cublasLtMatmulPreference_t raw_pref = nullptr;
    ST_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&raw_pref));
    const std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>,
                          decltype(&cublasLtMatmulPreferenceDestroy)>
        pref(raw_pref, &cublasLtMatmulPreferenceDestroy);
    const uint64_t max_ws = ws_bytes;
    ST_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref.get(), CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_ws, sizeof(max_ws)));
    const std::array<std::pair<cublasLtMatmulPreferenceAttributes_t, int64_t>, 4> aligns = {
        {{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_first},
         {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_second},
         {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c},
         {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_c}}};
    for (const auto& [attr, alignment] : aligns) {
      const uint32_t bytes = static_cast<uint32_t>(alignment);
      ST_CUBLAS_CHECK(
          cublasLtMatmulPreferenceSetAttribute(pref.get(), attr, &bytes, sizeof(bytes)));
    }
    // Split-K may add its partial products in the output type (bf16/fp16) unless told not to:
    // only fp32 (compute-type) reductions keep the one rounding per output element that the
    // accumulation promises. Algorithms without split-K are not affected by the mask.
    const uint32_t reductions = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    ST_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref.get(), CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reductions, sizeof(reductions)));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
        static_cast<cublasLtHandle_t>(handle(device)), plan->desc, plan->a, plan->b, plan->c,
        plan->c, pref.get(), 1, &result, &found);
    if (status == CUBLAS_STATUS_SUCCESS && found > 0) {
      plan->algo = result.algo;
      plan->workspace = result.workspaceSize;
    } else {
      plan->classic = true;
    }
    it = plans_.emplace(key, std::move(plan)).first;
  }
  const Plan& plan = *it->second;
  if (!plan.classic) {
    ST_CUBLAS_CHECK(cublasLtMatmul(static_cast<cublasLtHandle_t>(handle(device)), plan.desc,
                                   &p.alpha, p.b, plan.a, p.a, plan.b, &p.beta, p.c, plan.c, p.c,
                                   plan.c, &plan.algo, ws, plan.workspace, stream));
    return;
  }
  run_classic(device, stream, p, ws, ws_bytes);
}

void CublasLtGemm::run_classic(int device, cudaStream_t stream, const Problem& p, void* ws,
                               size_t ws_bytes) {
  // The same column-major product: first = B, second = A, C^T of n x m.
  const int64_t first_rows = p.trans_b ? p.k : p.n;
  const int64_t second_rows = p.trans_a ? p.m : p.k;
  constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
  ST_CHECK(p.m <= kMaxInt && p.n <= kMaxInt && p.k <= kMaxInt && p.batch <= kMaxInt, "gemm m=", p.m,
           " n=", p.n, " k=", p.k, " batch=", p.batch,
           ": cuBLASLt has no algorithm for these operands' alignment, and cuBLAS takes sizes "
           "below 2^31 only");
  auto h = static_cast<cublasHandle_t>(classic_handle(device));
  ST_CUBLAS_CHECK(cublasSetStream(h, stream));
  ST_CUBLAS_CHECK(cublasSetWorkspace(h, ws, ws_bytes));
  const cudaDataType_t in = cuda_type(p.in_type), out = cuda_type(p.out_type);
  const cublasStatus_t status = cublasGemmStridedBatchedEx(
      h, p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
      static_cast<int>(p.n), static_cast<int>(p.m), static_cast<int>(p.k), &p.alpha, p.b, in,
      static_cast<int>(first_rows), p.stride_b, p.a, in, static_cast<int>(second_rows), p.stride_a,
      &p.beta, p.c, out, static_cast<int>(p.n), p.stride_c, static_cast<int>(p.batch),
      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  ST_CHECK(status == CUBLAS_STATUS_SUCCESS, "gemm m=", p.m, " n=", p.n, " k=", p.k,
           " batch=", p.batch, " (", dtype_name(p.in_type), " -> ", dtype_name(p.out_type),
           ", trans_a=", p.trans_a, ", trans_b=", p.trans_b,
           "): cuBLASLt has no algorithm for these operands and cublasGemmStridedBatchedEx "
           "failed: ",
           cublasGetStatusString(status));
}

// ---- Backend::gemm --------------------------------------------------------------------------

void CudaBackend::gemm(const GemmArgs& g, const Tensor& a, const Tensor& b, Tensor& c) {
  check_gemm_args(g, a, b, c);
  if (g.m <= 0 || g.n <= 0 || g.batch <= 0) return;
  const int device = c.device().index;
  ST_CHECK(a.device().is_cuda() && b.device().is_cuda() && c.device().is_cuda() &&
               a.device() == c.device() && b.device() == c.device(),
           "CUDA gemm: operands ", a.describe(), ", ", b.describe(), ", ", c.describe(),
           " must be on one GPU");
  DeviceGuard guard(device);
  const auto stream = static_cast<cudaStream_t>(current_stream(device).handle());
  const int64_t c_elems = g.m * g.n;

  if (g.k <= 0 || g.alpha == 0.0f) {
    // Nothing to multiply: C = beta * C (C is not read when beta is 0, as in BLAS).
    for (int64_t i = 0; i < g.batch; ++i) {
      char* ci = static_cast<char*>(c.data_ptr()) +
                 (g.offset_c + i * g.stride_c) * static_cast<int64_t>(dtype_size(c.dtype()));
      if (g.beta == 0.0f)
        kernels::fill(ci, c.dtype(), c_elems, 0.0f, stream);
      else
        kernels::scale(ci, c.dtype(), ci, c.dtype(), c_elems, g.beta, stream);
    }
    return;
  }

  // Operands in one input type; C in that type or, for 16-bit inputs, F32. Other combinations
  // are converted through workspace copies (whole tensors, so offsets keep their meaning).
  const DType in_type = a.dtype() == b.dtype() ? a.dtype() : DType::F32;
  const bool direct_c = c.dtype() == in_type || (in_type != DType::F32 && c.dtype() == DType::F32);
  const DType out_type = direct_c ? c.dtype() : DType::F32;
  CategoryScope workspace(MemoryCategory::Workspace);
  auto converted = [&](const Tensor& t, DType type) {
    if (t.dtype() == type) return t;
    Tensor copy = empty(t.shape(), type, t.device());
    kernels::cast(t.data_ptr(), t.dtype(), copy.data_ptr(), type, t.numel(), stream);
    return copy;
  };
  const Tensor a_in = converted(a, in_type), b_in = converted(b, in_type);
  // A staged C starts as a copy of C so that elements outside the product keep their values.
  Tensor c_out = converted(c, out_type);

  auto at = [](const Tensor& t, int64_t offset) {
    return static_cast<char*>(t.data_ptr()) + offset * static_cast<int64_t>(dtype_size(t.dtype()));
  };
  CublasLtGemm::Problem p{g.trans_a,
                          g.trans_b,
                          g.m,
                          g.n,
                          g.k,
                          g.batch,
                          g.stride_a,
                          g.stride_b,
                          g.stride_c,
                          g.alpha,
                          g.beta,
                          in_type,
                          out_type,
                          at(a_in, g.offset_a),
                          at(b_in, g.offset_b),
                          at(c_out, g.offset_c)};
  gemm_.run(device, stream, p);
  if (!c_out.is_same(c))
    kernels::cast(c_out.data_ptr(), out_type, c.data_ptr(), c.dtype(), c.numel(), stream);
}

}  // namespace shardtrain::cuda
