// Host-side entry points of the CUDA kernels (kernels/*.cu), called by the CUDA backend.
//
// Every function enqueues its work on `stream` and returns without waiting, except the ones
// documented as synchronising (they return a value computed on the device). Pointers are device
// pointers of the current device; element counts are int64. Floating operands are F32, BF16 or
// F16 as their DType says; math is fp32 (reductions over many elements in fp64 where noted) and
// results are rounded once into the output type, like the CPU backend.
#pragma once
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "shardtrain/backend/attention.h"
#include "shardtrain/backend/rope.h"
#include "shardtrain/core/dtype.h"

namespace shardtrain::kernels {

// Temporary device memory for the duration of one backend call.
class Scratch {
 public:
  virtual ~Scratch() = default;
  // At least 256-byte aligned; valid until the Scratch is destroyed. Work that uses it must be
  // queued on the stream the Scratch allocates for.
  virtual void* get(size_t bytes) = 0;
};

// ---- elementwise.cu -------------------------------------------------------------------------
void fill(void* out, DType type, int64_t n, float value, cudaStream_t stream);
// Any dtypes (integers included), as convert_elements does on the host.
void cast(const void* src, DType src_type, void* dst, DType dst_type, int64_t n,
          cudaStream_t stream);
// out = alpha * a + beta * b; out may alias a or b.
void add(const void* a, DType ta, const void* b, DType tb, void* out, DType to, int64_t n,
         float alpha, float beta, cudaStream_t stream);
void mul(const void* a, DType ta, const void* b, DType tb, void* out, DType to, int64_t n,
         cudaStream_t stream);
void scale(const void* a, DType ta, void* out, DType to, int64_t n, float alpha,
           cudaStream_t stream);
// out[i] = x[i] * w[i % width]
void mul_lastdim(const void* x, DType tx, const void* w, DType tw, void* out, DType to, int64_t n,
                 int64_t width, cudaStream_t stream);
// grad_w[j] += sum_r dy[r, j] * x[r, j] (deterministic two-stage column sums)
void mul_lastdim_backward_weight(const void* dy, DType tdy, const void* x, DType tx, float* grad_w,
                                 int64_t rows, int64_t width, Scratch& scratch,
                                 cudaStream_t stream);

// ---- swiglu.cu ------------------------------------------------------------------------------
// All tensors of dtype `type`; outputs may alias inputs.
void swiglu_forward(const void* gate, const void* up, void* out, DType type, int64_t n,
                    cudaStream_t stream);
void swiglu_backward(const void* dout, const void* gate, const void* up, void* dgate, void* dup,
                     DType type, int64_t n, cudaStream_t stream);

// ---- layout.cu ------------------------------------------------------------------------------
// x [A, B, C, D] -> out [A, C, B, D], elements of `element_size` bytes copied unchanged.
void permute_0213(const void* x, void* out, size_t element_size, int64_t A, int64_t B, int64_t C,
                  int64_t D, cudaStream_t stream);

// ---- embedding.cu ---------------------------------------------------------------------------
// Position of the first id outside [0, limit) that is not `ignore`, or -1. Synchronises.
int64_t first_bad_index(const int64_t* ids, int64_t n, int64_t limit, int64_t ignore,
                        Scratch& scratch, cudaStream_t stream);
// out[i, :] = weight[ids[i], :]
void embedding_forward(const void* weight, DType tw, const int64_t* ids, void* out, DType to,
                       int64_t n, int64_t vocab, int64_t hidden, cudaStream_t stream);
// grad_weight[ids[i], :] += grad_out[i, :], deterministic (sort by id, then one ordered sum per
// distinct id).
void embedding_backward(const void* grad_out, DType tg, const int64_t* ids, float* grad_weight,
                        int64_t n, int64_t vocab, int64_t hidden, Scratch& scratch,
                        cudaStream_t stream);

// ---- rmsnorm.cu -----------------------------------------------------------------------------
// x and y of dtype `type`, w of dtype `tw`, rstd f32 [rows].
void rmsnorm_forward(const void* x, DType type, const void* w, DType tw, float eps, void* y,
                     float* rstd, int64_t rows, int64_t hidden, cudaStream_t stream);
// dy, x and dx of dtype `type` (dx may alias dy); dw f32 accumulated.
void rmsnorm_backward(const void* dy, const void* x, DType type, const void* w, DType tw,
                      const float* rstd, void* dx, float* dw, int64_t rows, int64_t hidden,
                      Scratch& scratch, cudaStream_t stream);

// ---- rope.cu --------------------------------------------------------------------------------
// x and out [B, S, H, D] of dtype `type`; out may alias x. The inverse frequencies are
// rope_inverse_frequencies(D, params) (backend/rope.h), formed on the host; with D > 1024 and
// Llama-3 scaling they are copied to `scratch` first.
void rope(const void* x, void* out, DType type, int64_t B, int64_t S, int64_t H, int64_t D,
          const RopeParams& params, int64_t position_offset, bool inverse, Scratch& scratch,
          cudaStream_t stream);

// ---- softmax.cu -----------------------------------------------------------------------------
// scores/probs [rows = N * Sq, Sk] of dtype `type`; probs may alias scores.
void causal_softmax(const void* scores, void* probs, DType type, int64_t rows, int64_t sq,
                    int64_t sk, float scale, cudaStream_t stream);
// dscores may alias dprobs.
void causal_softmax_backward(const void* probs, const void* dprobs, void* dscores, DType type,
                             int64_t rows, int64_t sk, float scale, cudaStream_t stream);

// ---- cross_entropy.cu -----------------------------------------------------------------------
void cross_entropy_forward(const void* logits, DType type, const int64_t* targets, float* losses,
                           int64_t rows, int64_t vocab, cudaStream_t stream);
// dlogits of dtype `type` (may alias logits).
void cross_entropy_backward(const void* logits, DType type, const int64_t* targets,
                            float grad_scale, void* dlogits, int64_t rows, int64_t vocab,
                            cudaStream_t stream);

// ---- reduce.cu ------------------------------------------------------------------------------
// One tensor of a list: `n` elements of `type` at `data`.
struct TensorSpan {
  void* data;
  DType type;
  int64_t n;
};
// Sum (or sum of squares) in fp64 with a fixed reduction tree. Synchronises.
double sum(const void* x, DType type, int64_t n, bool squares, Scratch& scratch,
           cudaStream_t stream);
// out[i] = sum of squares of tensors[i], each exactly what sum(..., squares) returns for it, with
// one synchronisation for the whole list (a model's gradient norm waits once, not per tensor).
void sum_squares_multi(const TensorSpan* tensors, int64_t count, double* out, Scratch& scratch,
                       cudaStream_t stream);
// x *= inv_scale; true when an element was inf or nan before scaling. Synchronises.
bool unscale_and_check(void* x, DType type, int64_t n, float inv_scale, Scratch& scratch,
                       cudaStream_t stream);
// The same for every tensor of the list, with one synchronisation: true when any had an inf
// or nan.
bool unscale_and_check_multi(const TensorSpan* tensors, int64_t count, float inv_scale,
                             Scratch& scratch, cudaStream_t stream);

// ---- adamw.cu -------------------------------------------------------------------------------
// Per-element constants of one AdamW step, formed on the host as the CPU backend does.
struct AdamWConstants {
  float decay;  // 1 - lr * weight_decay
  float beta1, beta2;
  float one_minus_beta1, one_minus_beta2;
  float step_size;   // lr / (1 - beta1^step)
  float bias2_sqrt;  // sqrt(1 - beta2^step)
  float eps;
  float grad_scale;  // each gradient element is multiplied by this first (clipping)
};
// The constants of step `step` (1-based) exactly as the CPU backend forms them: in double,
// rounded to float once.
inline AdamWConstants adamw_constants(float lr, float beta1, float beta2, float eps,
                                      float weight_decay, int64_t step, float grad_scale) {
  const double bc1 = 1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(step));
  AdamWConstants c;
  c.decay = static_cast<float>(1.0 - static_cast<double>(lr) * weight_decay);
  c.beta1 = beta1;
  c.beta2 = beta2;
  c.one_minus_beta1 = static_cast<float>(1.0 - static_cast<double>(beta1));
  c.one_minus_beta2 = static_cast<float>(1.0 - static_cast<double>(beta2));
  c.step_size = static_cast<float>(static_cast<double>(lr) / bc1);
  c.bias2_sqrt = static_cast<float>(std::sqrt(bc2));
  c.eps = eps;
  c.grad_scale = grad_scale;
  return c;
}
// One tensor of an AdamW step.
struct AdamWTensorRef {
  float* param;
  const void* grad;
  DType grad_type;
  float* m;
  float* v;
  int64_t n;
  float decay;  // this tensor's 1 - lr * weight_decay (constants.decay is not used)
};
// AdamW on every tensor of the list in a few launches: tensors are grouped by gradient dtype
// and vector alignment, and each launch takes up to 48 tensors (their pointers travel in the
// kernel's arguments), one block per chunk of 32768 elements. Each element's arithmetic is the
// CPU backend's, rounded operation by operation, so the results are its bits.
void adamw_multi(const AdamWTensorRef* tensors, int64_t count, const AdamWConstants& c,
                 cudaStream_t stream);

// ---- flash_attention.cu ---------------------------------------------------------------------
struct AttentionDims {
  int64_t batch, heads_q, heads_kv, seq, head_dim;
  float scale;
};
// Which (dtype, head_dim) run on the tensor-core kernels: cuda_attention_uses_tensor_cores
// (shardtrain/backend/attention.h), on a device whose blocks may take
// attention_tensor_core_smem(head_dim) bytes of shared memory, with 16-byte aligned operands.
// The most shared memory a tensor-core attention kernel at `head_dim` takes (0: none exists).
size_t attention_tensor_core_smem(int64_t head_dim);
// q, k, v, out of dtype `type`; lse f32 [B, Hq, S] (natural log).
void attention_forward(const AttentionDims& dims, const void* q, const void* k, const void* v,
                       DType type, void* out, float* lse, cudaStream_t stream);
// How the tensor-core backward runs (the CUDA-core kernels have one way, deterministic).
struct AttentionBackwardOptions {
  AttentionBackwardAlgo algo = AttentionBackwardAlgo::Deterministic;
  // Blocks that share one kv head's group of query heads in the dK/dV kernel, each adding fp32
  // partials that a last pass sums in a fixed order: 0 = chosen from the grid size and the GPU
  // (more than 1 only when the grid would be small); otherwise a divisor of the group.
  int group_split = 0;
  // 16-key m-tiles that each warp of the dK/dV kernel owns: 0 = the default for the head dim
  // (2 at 64, 1 at 128); 1 or 2 forced, 2 only at head dim 64.
  int dkdv_m_tiles = 0;
};
// All of dtype `type`; dq, dk, dv overwritten.
void attention_backward(const AttentionDims& dims, const void* q, const void* k, const void* v,
                        const void* out, const float* lse, const void* dout, DType type, void* dq,
                        void* dk, void* dv, const AttentionBackwardOptions& options,
                        Scratch& scratch, cudaStream_t stream);

}  // namespace shardtrain::kernels
