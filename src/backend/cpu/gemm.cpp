// Matrix products through OpenBLAS. BF16/F16 operands are converted to fp32 workspace first and
// the fp32 result is rounded once into C's dtype.
#include <cblas.h>

#include "cpu_backend.h"

namespace shardtrain {

namespace {

// Elements from a matrix's first element to the end of the last matrix of the batch.
int64_t batch_span(int64_t batch, int64_t stride, int64_t matrix_elements) {
  return (batch - 1) * stride + matrix_elements;
}

void scale_c(float* c, int64_t n, float beta) {
  if (beta == 0.0f) {
    std::fill(c, c + n, 0.0f);  // BLAS semantics: C is not read when beta is 0
    return;
  }
#pragma omp parallel for simd if (n > cpu::kChunk)
  for (int64_t i = 0; i < n; ++i) c[i] *= beta;
}

}  // namespace

void CpuBackend::gemm(const GemmArgs& g, const Tensor& a, const Tensor& b, Tensor& c) {
  check_gemm_args(g, a, b, c);
  if (g.m <= 0 || g.n <= 0 || g.batch <= 0) return;
  const int64_t a_elems = g.m * g.k, b_elems = g.k * g.n, c_elems = g.m * g.n;
  const int64_t c_span = batch_span(g.batch, g.stride_c, c_elems);

  const bool c_is_f32 = c.dtype() == DType::F32;
  Tensor c_scratch;
  float* c_base;  // element 0 of the first C matrix
  if (c_is_f32) {
    c_base = static_cast<float*>(c.data_ptr()) + g.offset_c;
  } else {
    c_scratch = cpu::workspace(c_span);
    c_base = static_cast<float*>(c_scratch.data_ptr());
  }

  if (g.k <= 0 || g.alpha == 0.0f) {
    // Nothing to multiply: C = beta * C.
    for (int64_t i = 0; i < g.batch; ++i) {
      float* ci = c_base + i * g.stride_c;
      if (!c_is_f32 && g.beta != 0.0f)
        cpu::load_floats(c, g.offset_c + i * g.stride_c, c_elems, ci);
      scale_c(ci, c_elems, g.beta);
      if (!c_is_f32) cpu::store_floats(ci, c_elems, c, g.offset_c + i * g.stride_c);
    }
    return;
  }

  // CBLAS takes its sizes as int: one past it would wrap to a wrong (negative) size.
  constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
  ST_CHECK(g.m <= kMaxInt && g.n <= kMaxInt && g.k <= kMaxInt, "matrix product m=", g.m, " n=", g.n,
           " k=", g.k,
           " has a side longer than BLAS takes (2^31 - 1): lower train.micro_batch or "
           "train.seq_len (or model.loss_chunk_tokens for the output layer)");
  cpu::Fp32Span a32(a, g.offset_a, batch_span(g.batch, g.stride_a, a_elems));
  cpu::Fp32Span b32(b, g.offset_b, batch_span(g.batch, g.stride_b, b_elems));
  const int lda = static_cast<int>(g.trans_a ? g.m : g.k);
  const int ldb = static_cast<int>(g.trans_b ? g.k : g.n);
  const int ldc = static_cast<int>(g.n);

  for (int64_t i = 0; i < g.batch; ++i) {
    float* ci = c_base + i * g.stride_c;
    const int64_t c_offset = g.offset_c + i * g.stride_c;
    if (!c_is_f32 && g.beta != 0.0f) cpu::load_floats(c, c_offset, c_elems, ci);
    // Called outside any OpenMP region: OpenBLAS parallelises internally.
    cblas_sgemm(CblasRowMajor, g.trans_a ? CblasTrans : CblasNoTrans,
                g.trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(g.m), static_cast<int>(g.n),
                static_cast<int>(g.k), g.alpha, a32.data() + i * g.stride_a, lda,
                b32.data() + i * g.stride_b, ldb, g.beta, ci, ldc);
    if (!c_is_f32) cpu::store_floats(ci, c_elems, c, c_offset);
  }
}

}  // namespace shardtrain
