// The CPU compute backend: OpenBLAS for matrix products, OpenMP loops for everything else.
//
// Every kernel reads its operands as fp32 (converting BF16/F16 on the fly), computes in fp32
// (reductions in double) and rounds once into the output dtype. Scratch memory that grows with
// the problem size is allocated as F32 tensors on the CPU device under MemoryCategory::Workspace,
// so it shows up in the memory ledger exactly like a GPU workspace would; only fixed-size stack
// buffers (kChunk floats) and per-chunk partial sums live outside the ledger.
//
// Kernels whose results are accumulated across rows (reductions, embedding and weight gradients,
// attention key/value gradients) give results that do not depend on the number of threads.
#pragma once
#include <algorithm>
#include <cstdint>

#include "shardtrain/backend/backend.h"

namespace shardtrain {

class CpuBackend : public Backend {
 public:
  Device device() const override { return Device::cpu(); }

  void gemm(const GemmArgs& args, const Tensor& a, const Tensor& b, Tensor& c) override;

  void fill(Tensor& out, float value) override;
  void cast(const Tensor& src, Tensor& dst) override;
  void add(const Tensor& a, const Tensor& b, Tensor& out, float alpha, float beta) override;
  void mul(const Tensor& a, const Tensor& b, Tensor& out) override;
  void scale(const Tensor& a, Tensor& out, float alpha) override;
  void mul_lastdim(const Tensor& x, const Tensor& w, Tensor& out) override;
  void mul_lastdim_backward_weight(const Tensor& dy, const Tensor& x, Tensor& grad_w) override;

  void permute_0213(const Tensor& x, Tensor& out) override;

  void embedding_forward(const Tensor& weight, const Tensor& ids, Tensor& out) override;
  void embedding_backward(const Tensor& grad_out, const Tensor& ids, Tensor& grad_weight) override;

  void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, Tensor& y,
                       Tensor& rstd) override;
  void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                        Tensor& dx, Tensor& dw) override;

  void rope(const Tensor& x, Tensor& out, const RopeParams& params, int64_t position_offset,
            bool inverse) override;

  void causal_softmax(const Tensor& scores, float scale, Tensor& probs) override;
  void causal_softmax_backward(const Tensor& probs, const Tensor& dprobs, float scale,
                               Tensor& dscores) override;

  void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, float scale,
                         Tensor& out, Tensor& lse) override;
  void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                          const Tensor& lse, const Tensor& dout, float scale, Tensor& dq,
                          Tensor& dk, Tensor& dv, AttentionBackwardAlgo algo) override;

  void swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& out) override;
  void swiglu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate,
                       Tensor& dup) override;

  void cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& losses,
                             bool targets_checked = false) override;
  void cross_entropy_backward(const Tensor& logits, const Tensor& targets, float grad_scale,
                              Tensor& dlogits, bool targets_checked = false) override;

  void nf4_dequantize(const Tensor& codes, const Tensor& absmax_q, const Tensor& absmax_scale,
                      float offset, Tensor& out) override;

  double sum(const Tensor& x) override;
  double sum_squares(const Tensor& x) override;

  bool unscale_and_check(Tensor& x, float inv_scale) override;
  void adamw(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v,
             const AdamWArgs& args) override;
};

namespace cpu {

// Elements processed per step by the chunked loops (fits fp32 stack buffers comfortably).
constexpr int64_t kChunk = 1024;
// Columns per task in kernels that sum over rows with one thread per column block (weight
// gradients): small enough to spread a hidden dimension over many threads.
constexpr int64_t kColumnBlock = 256;

// Reads n elements starting at element `offset` of a float tensor's memory into fp32.
inline void load_floats(const void* base, DType type, int64_t offset, int64_t n, float* dst) {
  switch (type) {
    case DType::F32: {
      const float* s = static_cast<const float*>(base) + offset;
      std::copy(s, s + n, dst);
      return;
    }
    case DType::BF16: {
      const uint16_t* s = static_cast<const uint16_t*>(base) + offset;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(s[i]);
      return;
    }
    case DType::F16: {
      const uint16_t* s = static_cast<const uint16_t*>(base) + offset;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_float(s[i]);
      return;
    }
    default:
      convert_elements(static_cast<const char*>(base) + offset * dtype_size(type), type, dst,
                       DType::F32, n);
  }
}

// Writes n fp32 values to element `offset` onwards, rounding to nearest even into `type`.
inline void store_floats(const float* src, int64_t n, void* base, DType type, int64_t offset) {
  switch (type) {
    case DType::F32: {
      std::copy(src, src + n, static_cast<float*>(base) + offset);
      return;
    }
    case DType::BF16: {
      uint16_t* d = static_cast<uint16_t*>(base) + offset;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) d[i] = float_to_bf16(src[i]);
      return;
    }
    case DType::F16: {
      uint16_t* d = static_cast<uint16_t*>(base) + offset;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) d[i] = float_to_f16(src[i]);
      return;
    }
    default:
      convert_elements(src, DType::F32, static_cast<char*>(base) + offset * dtype_size(type), type,
                       n);
  }
}

inline void load_floats(const Tensor& t, int64_t offset, int64_t n, float* dst) {
  load_floats(t.data_ptr(), t.dtype(), offset, n, dst);
}
inline void store_floats(const float* src, int64_t n, Tensor& t, int64_t offset) {
  store_floats(src, n, t.data_ptr(), t.dtype(), offset);
}

// Calls body(begin, end) for consecutive kChunk-sized ranges of [0, n), in parallel.
template <typename Body>
void parallel_chunks(int64_t n, Body body) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) body(c * kChunk, std::min(n, (c + 1) * kChunk));
}

// fp32 scratch counted as workspace on the CPU device.
Tensor workspace(int64_t n);

// An fp32 view of elements [offset, offset + n) of a float tensor: the tensor's own memory when
// it is F32, otherwise a converted workspace copy. data()[i] is element offset + i.
class Fp32Span {
 public:
  Fp32Span(const Tensor& t, int64_t offset, int64_t n);
  explicit Fp32Span(const Tensor& t) : Fp32Span(t, 0, t.numel()) {}
  const float* data() const { return data_; }

 private:
  Tensor holder_;
  const float* data_ = nullptr;
};

// "No id is ignored" for check_indices: 0, which the range check accepts anyway whenever there is
// a vocabulary at all. (A sentinel outside the ids' range, such as INT64_MIN, would let that very
// id through, and its row address wrap around.)
constexpr int64_t kNoIgnoredIndex = 0;
// Validates that every id lies in [0, limit) (or equals `ignore`) and throws ShapeError naming
// `what` and the first bad position otherwise.
void check_indices(const Tensor& ids, int64_t limit, int64_t ignore, const char* what);

}  // namespace cpu
}  // namespace shardtrain
