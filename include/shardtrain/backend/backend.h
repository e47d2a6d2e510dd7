// The compute backend interface: the kernels every op is built from, one implementation per
// device kind (backend/cpu with OpenBLAS + OpenMP, backend/cuda with cuBLASLt + kernels/*.cu).
//
// Conventions for every kernel:
//  - All tensors are contiguous; `out`/`grad` tensors are allocated by the caller with the
//    documented shape and dtype. Shapes are checked by the ops layer, not here.
//  - Floating tensors may be F32, BF16 or F16; math is always done in fp32 and results are rounded
//    once into the output's dtype. "f32" in a comment means the tensor must be F32.
//  - Index tensors (token ids, targets) are I64.
//  - Kernels that "accumulate" add into their output; all others overwrite it.
//  - Reductions that return a number return it to the host (they synchronise).
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "shardtrain/backend/attention.h"
#include "shardtrain/backend/rope.h"
#include "shardtrain/tensor/tensor.h"

namespace shardtrain {

struct GemmArgs {
  bool trans_a = false;  // use A^T
  bool trans_b = false;  // use B^T
  int64_t m = 0, n = 0, k = 0;
  float alpha = 1.0f;
  float beta = 0.0f;  // C = alpha*op(A)@op(B) + beta*C
  int64_t batch = 1;
  // Element strides between consecutive matrices of the batch (0 = broadcast the same matrix).
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;
  // Element offsets of the first matrix inside each tensor.
  int64_t offset_a = 0, offset_b = 0, offset_c = 0;
};

// Throws ShapeError unless `g` describes products that stay inside a, b and c and write disjoint
// C matrices. Both backends call it before touching memory: a wrong stride or offset from a
// caller is an error message, not a read or write past a tensor.
void check_gemm_args(const GemmArgs& g, const Tensor& a, const Tensor& b, const Tensor& c);

class Backend {
 public:
  virtual ~Backend() = default;
  virtual Device device() const = 0;
  virtual void synchronize() {}

  // ---- dense linear algebra ----
  // Row-major: op(A) is m x k, op(B) is k x n, C is m x n; A is stored m x k (k x m if trans_a),
  // B is stored k x n (n x k if trans_b). A, B, C may have different float dtypes.
  // Every matrix of the batch must lie inside its tensor, and the C matrices must not overlap
  // (stride_c >= m * n when batch > 1): check_gemm_args says which bound is broken.
  virtual void gemm(const GemmArgs& args, const Tensor& a, const Tensor& b, Tensor& c) = 0;

  // ---- elementwise ----
  virtual void fill(Tensor& out, float value) = 0;
  virtual void cast(const Tensor& src, Tensor& dst) = 0;  // any dtypes, same numel
  // out = alpha * a + beta * b   (out may alias a or b)
  virtual void add(const Tensor& a, const Tensor& b, Tensor& out, float alpha, float beta) = 0;
  // out = a * b  (elementwise, same numel; out may alias a or b)
  virtual void mul(const Tensor& a, const Tensor& b, Tensor& out) = 0;
  // out = alpha * a (out may alias a)
  virtual void scale(const Tensor& a, Tensor& out, float alpha) = 0;
  // out[i] = x[i] * w[i % w.numel()]  (broadcast over the last dimension); out may alias x
  virtual void mul_lastdim(const Tensor& x, const Tensor& w, Tensor& out) = 0;
  // grad_w[j] (+)= sum_i dy[i, j] * x[i, j] over rows  (f32 grad_w, accumulate)
  virtual void mul_lastdim_backward_weight(const Tensor& dy, const Tensor& x, Tensor& grad_w) = 0;

  // ---- layout ----
  // x [A, B, C, D] -> out [A, C, B, D]
  virtual void permute_0213(const Tensor& x, Tensor& out) = 0;

  // ---- transformer pieces ----
  // out[i, :] = weight[ids[i], :]     ids I64 [N], weight [V, H], out [N, H]
  virtual void embedding_forward(const Tensor& weight, const Tensor& ids, Tensor& out) = 0;
  // grad_weight[ids[i], :] += grad_out[i, :]   (f32 grad_weight, accumulate, deterministic)
  virtual void embedding_backward(const Tensor& grad_out, const Tensor& ids,
                                  Tensor& grad_weight) = 0;

  // y = x * rstd * w with rstd = 1/sqrt(mean(x^2) + eps) per row; x [N, H], w [H], y [N, H],
  // rstd f32 [N] (saved for backward).
  virtual void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, Tensor& y,
                               Tensor& rstd) = 0;
  // dx = (overwrite) input gradient; dw (+)= weight gradient (f32, accumulate).
  virtual void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w,
                                const Tensor& rstd, Tensor& dx, Tensor& dw) = 0;

  // Rotary embedding, Hugging Face rotate-half convention, on x [B, S, H, D] (D even):
  // for i < D/2, angle = (position_offset + s) * inv_freq[i] with inv_freq =
  // rope_inverse_frequencies(D, params) (theta^(-2i/D), Llama-3 scaled when params.llama3),
  //   out[..., i]       = x[i] cos - x[i + D/2] sin
  //   out[..., i + D/2] = x[i + D/2] cos + x[i] sin
  // inverse = true rotates by -angle (the backward of the forward rotation). out may alias x.
  virtual void rope(const Tensor& x, Tensor& out, const RopeParams& params, int64_t position_offset,
                    bool inverse) = 0;

  // Causal softmax over score blocks: scores [N, S_q, S_k] with query row q attending keys
  // k <= q + (S_k - S_q); probs[..] = softmax(scale * scores) with masked entries 0.
  // probs may alias scores.
  virtual void causal_softmax(const Tensor& scores, float scale, Tensor& probs) = 0;
  // dscores = scale * probs * (dprobs - sum_k(probs * dprobs)); dscores may alias dprobs.
  virtual void causal_softmax_backward(const Tensor& probs, const Tensor& dprobs, float scale,
                                       Tensor& dscores) = 0;

  // Memory-efficient causal attention (flash-attention style; never materialises S x S).
  // q [B, Hq, S, D], k/v [B, Hkv, S, D] with Hq % Hkv == 0 (grouped-query: head h uses kv head
  // h / (Hq/Hkv)); out [B, Hq, S, D]; lse f32 [B, Hq, S] (log-sum-exp of scaled scores per row).
  virtual void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, float scale,
                                 Tensor& out, Tensor& lse) = 0;
  // Overwrites dq [B,Hq,S,D], dk and dv [B,Hkv,S,D]. `algo` may let dQ be summed in a
  // run-dependent order where the backend has such a kernel (backend/attention.h).
  virtual void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& out, const Tensor& lse, const Tensor& dout,
                                  float scale, Tensor& dq, Tensor& dk, Tensor& dv,
                                  AttentionBackwardAlgo algo) = 0;

  // SwiGLU: out = silu(gate) * up, silu(x) = x * sigmoid(x). All same shape.
  virtual void swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& out) = 0;
  virtual void swiglu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up,
                               Tensor& dgate, Tensor& dup) = 0;

  // Cross-entropy per row: logits [N, V], targets I64 [N] (-100 = ignored);
  // losses f32 [N] = logsumexp(logits[i]) - logits[i, t_i], 0 for ignored rows.
  // Targets outside [0, V) raise ShapeError unless `targets_checked` says the caller has checked
  // them already (on a GPU the check reads a flag back: one host wait per call, which a loss
  // computed chunk by chunk would pay per chunk).
  virtual void cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& losses,
                                     bool targets_checked = false) = 0;
  // dlogits[i, :] = grad_scale * (softmax(logits[i]) - onehot(t_i)), 0 rows for ignored targets.
  // dlogits may be logits itself (the chunked loss overwrites each chunk's logits).
  virtual void cross_entropy_backward(const Tensor& logits, const Tensor& targets, float grad_scale,
                                      Tensor& dlogits, bool targets_checked = false) = 0;

  // ---- quantized weights ----
  // NF4 with double-quantized block scales (layout and formula in backend/nf4_codebook.h: blocks
  // of 64 weights, absmax groups of 256): codes U8 [ceil(n/2)], absmax_q U8 [ceil(n/64)],
  // absmax_scale f32 [ceil(n/64/256)]; out (any float dtype, n = out.numel()) is overwritten
  // with the dequantized weights. Bitwise identical on every backend.
  virtual void nf4_dequantize(const Tensor& codes, const Tensor& absmax_q,
                              const Tensor& absmax_scale, float offset, Tensor& out) = 0;

  // ---- reductions (synchronising, result in fp64 on the host) ----
  virtual double sum(const Tensor& x) = 0;
  virtual double sum_squares(const Tensor& x) = 0;

  // ---- optimizer and loss-scaling support ----
  // x *= inv_scale in place; returns true when any element of x (before scaling) is inf or nan.
  virtual bool unscale_and_check(Tensor& x, float inv_scale) = 0;
  // The same on every tensor of a list (all of them are unscaled); true when any had an inf or
  // nan. The default calls unscale_and_check per tensor; the CUDA backend waits once for the
  // whole list instead of once per tensor.
  virtual bool unscale_and_check_multi(const std::vector<Tensor*>& tensors, float inv_scale);
  // out[i] = sum_squares(*tensors[i]), bit for bit; the CUDA backend waits once for the list
  // (a gradient norm over a model's tensors).
  virtual std::vector<double> sum_squares_multi(const std::vector<const Tensor*>& tensors);
  // One AdamW step on f32 param/m/v with gradient g (any float dtype), PyTorch semantics:
  //   g = grad_scale * g (in fp32)
  //   p -= lr * weight_decay * p
  //   m = beta1 m + (1-beta1) g ; v = beta2 v + (1-beta2) g^2
  //   p -= lr * (m / (1-beta1^step)) / (sqrt(v / (1-beta2^step)) + eps)
  // grad_scale is how global-norm clipping reaches the update without a pass of its own over the
  // gradients: fp32 gradients scaled here give the bits they would give scaled in place first.
  struct AdamWArgs {
    float lr, beta1, beta2, eps, weight_decay;
    int64_t step;  // 1-based
    float grad_scale = 1.0f;
  };
  virtual void adamw(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v,
                     const AdamWArgs& args) = 0;
  // The same step on many tensors at once: every entry gets `args`, except that weight decay
  // applies only to the entries marked `decay`. The result is adamw()'s for each entry, bit for
  // bit. The default calls adamw() per entry; the CUDA backend updates the list in a few
  // launches (multi-tensor apply), since one launch per tensor of a model costs microseconds
  // each.
  struct AdamWTensor {
    Tensor* param;
    const Tensor* grad;
    Tensor* m;
    Tensor* v;
    bool decay;
  };
  virtual void adamw_multi(const std::vector<AdamWTensor>& tensors, const AdamWArgs& args);
};

// `items` split by the device each is on (`device_of(item)`), devices in order of first
// appearance, items in their order within a device: one list per call of a *_multi kernel.
template <typename Item, typename DeviceOf>
std::vector<std::pair<Device, std::vector<Item>>> split_by_device(const std::vector<Item>& items,
                                                                  DeviceOf device_of) {
  std::vector<std::pair<Device, std::vector<Item>>> lists;
  for (const Item& item : items) {
    const Device device = device_of(item);
    size_t i = 0;
    while (i < lists.size() && !(lists[i].first == device)) ++i;
    if (i == lists.size()) lists.push_back({device, {}});
    lists[i].second.push_back(item);
  }
  return lists;
}

// The backend that computes on `device` (CPU for Device::cpu() and the host pool).
Backend& backend_for(Device device);
void register_backend(DeviceKind kind, Backend* backend);
bool cuda_backend_available();  // built with CUDA and a GPU is usable

}  // namespace shardtrain
