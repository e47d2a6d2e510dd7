#include "cuda_backend.h"

#include <cmath>
#include <initializer_list>

#include "shardtrain/backend/attention.h"
#include "shardtrain/core/error.h"

namespace shardtrain::cuda {

void* CallScratch::get(size_t bytes) {
  buffers_.emplace_back(bytes == 0 ? 1 : bytes, Device::cuda(device_), MemoryCategory::Workspace);
  return buffers_.back().get();
}

namespace {

int device_of(std::initializer_list<const Tensor*> tensors, const char* op) {
  int device = -1;
  for (const Tensor* t : tensors) {
    ST_CHECK(t->defined(), "CUDA ", op, ": an operand is undefined");
    ST_CHECK(t->device().is_cuda(), "CUDA ", op, ": operand ", t->describe(),
             " is not on a GPU; move it with .to(Device::cuda())");
    if (device < 0) device = t->device().index;
    ST_CHECK(t->device().index == device, "CUDA ", op, ": operands on different GPUs (",
             t->describe(), " vs cuda:", device, ")");
  }
  return device;
}

// The device, stream and scratch memory of one backend call.
struct Call {
  Call(std::initializer_list<const Tensor*> tensors, const char* op)
      : device(device_of(tensors, op)),
        guard(device),
        stream(static_cast<cudaStream_t>(current_stream(device).handle())),
        scratch(device) {}
  int device;
  DeviceGuard guard;
  cudaStream_t stream;
  CallScratch scratch;
};

// `t` as `type`: itself, or a converted copy counted as workspace.
Tensor as_type(const Tensor& t, DType type, const Call& call) {
  if (t.dtype() == type) return t;
  CategoryScope workspace(MemoryCategory::Workspace);
  Tensor converted = empty(t.shape(), type, t.device());
  kernels::cast(t.data_ptr(), t.dtype(), converted.data_ptr(), type, t.numel(), call.stream);
  return converted;
}

// The dtype a kernel computes in when its float operands differ: their common dtype, or fp32 when
// they mix. A kernel reads its inputs and rounds into its output in this one dtype, so widening
// the inputs is exact and an fp32 output of 16-bit inputs is rounded once, as the CPU backend
// rounds it (not to 16 bits first).
DType compute_type(std::initializer_list<DType> types) {
  const DType first = *types.begin();
  for (DType t : types)
    if (t != first) return DType::F32;
  return first;
}

// An output that a kernel writes as `type`: the output itself when it has that dtype, otherwise
// a workspace tensor converted into the output by finish().
class StagedOutput {
 public:
  StagedOutput(Tensor& out, DType type, const Call& call) : out_(out), call_(call) {
    if (out.dtype() == type) {
      tensor_ = out;
    } else {
      CategoryScope workspace(MemoryCategory::Workspace);
      tensor_ = empty(out.shape(), type, out.device());
    }
  }
  void* data() const { return tensor_.data_ptr(); }
  void finish() {
    if (tensor_.is_same(out_)) return;
    kernels::cast(tensor_.data_ptr(), tensor_.dtype(), out_.data_ptr(), out_.dtype(), out_.numel(),
                  call_.stream);
  }

 private:
  Tensor& out_;
  const Call& call_;
  Tensor tensor_;
};

void require_f32(const Tensor& t, const char* what) {
  ST_CHECK_SHAPE(t.dtype() == DType::F32, what, " must be f32, got ", t.describe());
}

// Throws the CPU backend's ShapeError when an index is outside [0, limit) and not `ignore`.
void check_indices(const Tensor& ids, int64_t limit, int64_t ignore, const char* what, Call& call) {
  ST_CHECK_SHAPE(ids.dtype() == DType::I64, what, " must be int64, got ", ids.describe());
  const int64_t* p = static_cast<const int64_t*>(ids.data_ptr());
  const int64_t bad =
      kernels::first_bad_index(p, ids.numel(), limit, ignore, call.scratch, call.stream);
  if (bad < 0) return;
  int64_t value = 0;
  ST_CUDA_CHECK(
      cudaMemcpyAsync(&value, p + bad, sizeof(value), cudaMemcpyDeviceToHost, call.stream));
  ST_CUDA_CHECK(cudaStreamSynchronize(call.stream));
  throw ShapeError(shardtrain::detail::concat(
      what, " ", value, " at position ", bad, " is outside [0, ", limit, ")",
      value < 0 ? ": ids are never negative (the input was built wrongly)"
                : ": the data was tokenized with a vocabulary larger than the model's vocab_size"));
}

// "No id is ignored" for check_indices: 0, which the range check accepts anyway whenever there is
// a vocabulary at all. (A sentinel outside the ids' range, such as INT64_MIN, would let that very
// id through, and its row address wrap around.)
constexpr int64_t kNoIgnoredIndex = 0;
constexpr int64_t kIgnoreIndex = -100;

}  // namespace

// ---- device, synchronisation ----------------------------------------------------------------

Device CudaBackend::device() const {
  return Device::cuda(current_device());
}

void CudaBackend::synchronize() {
  current_stream().synchronize();
}

// ---- elementwise ----------------------------------------------------------------------------

void CudaBackend::fill(Tensor& out, float value) {
  Call call({&out}, "fill");
  kernels::fill(out.data_ptr(), out.dtype(), out.numel(), value, call.stream);
}

void CudaBackend::cast(const Tensor& src, Tensor& dst) {
  Call call({&src, &dst}, "cast");
  ST_CHECK_SHAPE(src.numel() == dst.numel(), "cast of ", src.describe(), " into ", dst.describe(),
                 ": element counts differ");
  kernels::cast(src.data_ptr(), src.dtype(), dst.data_ptr(), dst.dtype(), src.numel(), call.stream);
}

void CudaBackend::add(const Tensor& a, const Tensor& b, Tensor& out, float alpha, float beta) {
  Call call({&a, &b, &out}, "add");
  kernels::add(a.data_ptr(), a.dtype(), b.data_ptr(), b.dtype(), out.data_ptr(), out.dtype(),
               out.numel(), alpha, beta, call.stream);
}

void CudaBackend::mul(const Tensor& a, const Tensor& b, Tensor& out) {
  Call call({&a, &b, &out}, "mul");
  kernels::mul(a.data_ptr(), a.dtype(), b.data_ptr(), b.dtype(), out.data_ptr(), out.dtype(),
               out.numel(), call.stream);
}

void CudaBackend::scale(const Tensor& a, Tensor& out, float alpha) {
  Call call({&a, &out}, "scale");
  kernels::scale(a.data_ptr(), a.dtype(), out.data_ptr(), out.dtype(), out.numel(), alpha,
                 call.stream);
}

void CudaBackend::mul_lastdim(const Tensor& x, const Tensor& w, Tensor& out) {
  Call call({&x, &w, &out}, "mul_lastdim");
  kernels::mul_lastdim(x.data_ptr(), x.dtype(), w.data_ptr(), w.dtype(), out.data_ptr(),
                       out.dtype(), out.numel(), w.numel(), call.stream);
}

void CudaBackend::mul_lastdim_backward_weight(const Tensor& dy, const Tensor& x, Tensor& grad_w) {
  Call call({&dy, &x, &grad_w}, "mul_lastdim_backward_weight");
  require_f32(grad_w, "mul_lastdim weight gradient");
  const int64_t width = grad_w.numel();
  if (width == 0) return;
  kernels::mul_lastdim_backward_weight(dy.data_ptr(), dy.dtype(), x.data_ptr(), x.dtype(),
                                       static_cast<float*>(grad_w.data_ptr()), dy.numel() / width,
                                       width, call.scratch, call.stream);
}

// ---- layout ---------------------------------------------------------------------------------

void CudaBackend::permute_0213(const Tensor& x, Tensor& out) {
  Call call({&x, &out}, "permute_0213");
  ST_CHECK_SHAPE(x.dim() == 4, "permute_0213 needs a 4-d tensor, got ", x.describe());
  StagedOutput o(out, x.dtype(), call);
  kernels::permute_0213(x.data_ptr(), o.data(), dtype_size(x.dtype()), x.size(0), x.size(1),
                        x.size(2), x.size(3), call.stream);
  o.finish();
}

// ---- embedding ------------------------------------------------------------------------------

void CudaBackend::embedding_forward(const Tensor& weight, const Tensor& ids, Tensor& out) {
  Call call({&weight, &ids, &out}, "embedding_forward");
  const int64_t V = weight.size(0), H = weight.size(1), N = ids.numel();
  check_indices(ids, V, kNoIgnoredIndex, "token id", call);
  kernels::embedding_forward(weight.data_ptr(), weight.dtype(),
                             static_cast<const int64_t*>(ids.data_ptr()), out.data_ptr(),
                             out.dtype(), N, V, H, call.stream);
}

void CudaBackend::embedding_backward(const Tensor& grad_out, const Tensor& ids,
                                     Tensor& grad_weight) {
  Call call({&grad_out, &ids, &grad_weight}, "embedding_backward");
  require_f32(grad_weight, "embedding weight gradient");
  const int64_t V = grad_weight.size(0), H = grad_weight.size(1), N = ids.numel();
  check_indices(ids, V, kNoIgnoredIndex, "token id", call);
  kernels::embedding_backward(
      grad_out.data_ptr(), grad_out.dtype(), static_cast<const int64_t*>(ids.data_ptr()),
      static_cast<float*>(grad_weight.data_ptr()), N, V, H, call.scratch, call.stream);
}

// ---- normalisation, rotary, softmax ---------------------------------------------------------

void CudaBackend::rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, Tensor& y,
                                  Tensor& rstd) {
  Call call({&x, &w, &y, &rstd}, "rmsnorm_forward");
  require_f32(rstd, "rmsnorm rstd");
  const int64_t H = w.numel();
  const int64_t N = H == 0 ? 0 : x.numel() / H;
  const DType t = compute_type({x.dtype(), y.dtype()});
  const Tensor xt = as_type(x, t, call);
  StagedOutput yo(y, t, call);
  kernels::rmsnorm_forward(xt.data_ptr(), t, w.data_ptr(), w.dtype(), eps, yo.data(),
                           static_cast<float*>(rstd.data_ptr()), N, H, call.stream);
  yo.finish();
}

void CudaBackend::rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w,
                                   const Tensor& rstd, Tensor& dx, Tensor& dw) {
  Call call({&dy, &x, &w, &rstd, &dx, &dw}, "rmsnorm_backward");
  require_f32(rstd, "rmsnorm rstd");
  require_f32(dw, "rmsnorm weight gradient");
  const int64_t H = w.numel();
  const int64_t N = H == 0 ? 0 : x.numel() / H;
  const DType t = compute_type({dy.dtype(), x.dtype(), dx.dtype()});
  const Tensor dy_t = as_type(dy, t, call), xt = as_type(x, t, call);
  StagedOutput dxo(dx, t, call);
  kernels::rmsnorm_backward(dy_t.data_ptr(), xt.data_ptr(), t, w.data_ptr(), w.dtype(),
                            static_cast<const float*>(rstd.data_ptr()), dxo.data(),
                            static_cast<float*>(dw.data_ptr()), N, H, call.scratch, call.stream);
  dxo.finish();
}

void CudaBackend::rope(const Tensor& x, Tensor& out, const RopeParams& params,
                       int64_t position_offset, bool inverse) {
  Call call({&x, &out}, "rope");
  ST_CHECK_SHAPE(x.dim() == 4 && x.size(3) % 2 == 0, "rope needs x [B, S, H, D] with even D, got ",
                 x.describe());
  const DType t = compute_type({x.dtype(), out.dtype()});
  const Tensor xt = as_type(x, t, call);
  StagedOutput o(out, t, call);
  kernels::rope(xt.data_ptr(), o.data(), t, x.size(0), x.size(1), x.size(2), x.size(3), params,
                position_offset, inverse, call.scratch, call.stream);
  o.finish();
}

void CudaBackend::causal_softmax(const Tensor& scores, float scale, Tensor& probs) {
  Call call({&scores, &probs}, "causal_softmax");
  const int64_t Sk = scores.size(-1), Sq = scores.size(-2);
  const int64_t rows = Sk == 0 ? 0 : scores.numel() / Sk;
  const DType t = compute_type({scores.dtype(), probs.dtype()});
  const Tensor st = as_type(scores, t, call);
  StagedOutput o(probs, t, call);
  kernels::causal_softmax(st.data_ptr(), o.data(), t, rows, Sq, Sk, scale, call.stream);
  o.finish();
}

void CudaBackend::causal_softmax_backward(const Tensor& probs, const Tensor& dprobs, float scale,
                                          Tensor& dscores) {
  Call call({&probs, &dprobs, &dscores}, "causal_softmax_backward");
  const int64_t Sk = probs.size(-1);
  const int64_t rows = Sk == 0 ? 0 : probs.numel() / Sk;
  const DType t = compute_type({probs.dtype(), dprobs.dtype(), dscores.dtype()});
  const Tensor pt = as_type(probs, t, call), dp = as_type(dprobs, t, call);
  StagedOutput o(dscores, t, call);
  kernels::causal_softmax_backward(pt.data_ptr(), dp.data_ptr(), o.data(), t, rows, Sk, scale,
                                   call.stream);
  o.finish();
}

// ---- attention ------------------------------------------------------------------------------

namespace {
kernels::AttentionDims attention_dims(const Tensor& q, const Tensor& k, float scale) {
  ST_CHECK_SHAPE(q.dim() == 4 && k.dim() == 4,
                 "attention needs q [B, Hq, S, D] and k/v "
                 "[B, Hkv, S, D], got ",
                 q.describe(), " and ", k.describe());
  kernels::AttentionDims d{q.size(0), q.size(1), k.size(1), q.size(2), q.size(3), scale};
  ST_CHECK_SHAPE(d.heads_kv > 0 && d.heads_q % d.heads_kv == 0, "attention: ", d.heads_q,
                 " query heads are not a multiple of ", d.heads_kv, " key/value heads");
  return d;
}
}  // namespace

bool attention_uses_tensor_cores(int device, DType type, int64_t head_dim) {
  return cuda_attention_uses_tensor_cores(type, head_dim) &&
         static_cast<int64_t>(kernels::attention_tensor_core_smem(head_dim)) <=
             shared_memory_per_block_optin(device);
}

void CudaBackend::attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, float scale,
                                    Tensor& out, Tensor& lse) {
  Call call({&q, &k, &v, &out, &lse}, "attention_forward");
  require_f32(lse, "attention lse");
  const kernels::AttentionDims d = attention_dims(q, k, scale);
  if (d.batch * d.heads_q * d.seq == 0) return;
  const DType t = compute_type({q.dtype(), k.dtype(), v.dtype(), out.dtype()});
  const Tensor qt = as_type(q, t, call), kt = as_type(k, t, call), vt = as_type(v, t, call);
  StagedOutput o(out, t, call);
  kernels::attention_forward(d, qt.data_ptr(), kt.data_ptr(), vt.data_ptr(), t, o.data(),
                             static_cast<float*>(lse.data_ptr()), call.stream);
  o.finish();
}

void CudaBackend::attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                     const Tensor& out, const Tensor& lse, const Tensor& dout,
                                     float scale, Tensor& dq, Tensor& dk, Tensor& dv,
                                     AttentionBackwardAlgo algo) {
  Call call({&q, &k, &v, &out, &lse, &dout, &dq, &dk, &dv}, "attention_backward");
  require_f32(lse, "attention lse");
  const kernels::AttentionDims d = attention_dims(q, k, scale);
  if (d.batch * d.heads_q * d.seq == 0 || d.head_dim == 0) {
    fill(dq, 0.0f);
    fill(dk, 0.0f);
    fill(dv, 0.0f);
    return;
  }
  const DType t = compute_type({q.dtype(), k.dtype(), v.dtype(), out.dtype(), dout.dtype(),
                                dq.dtype(), dk.dtype(), dv.dtype()});
  const Tensor qt = as_type(q, t, call), kt = as_type(k, t, call), vt = as_type(v, t, call);
  const Tensor ot = as_type(out, t, call), dot = as_type(dout, t, call);
  StagedOutput dqo(dq, t, call), dko(dk, t, call), dvo(dv, t, call);
  kernels::attention_backward(d, qt.data_ptr(), kt.data_ptr(), vt.data_ptr(), ot.data_ptr(),
                              static_cast<const float*>(lse.data_ptr()), dot.data_ptr(), t,
                              dqo.data(), dko.data(), dvo.data(), {algo, 0}, call.scratch,
                              call.stream);
  dqo.finish();
  dko.finish();
  dvo.finish();
}

// ---- SwiGLU ---------------------------------------------------------------------------------

void CudaBackend::swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& out) {
  Call call({&gate, &up, &out}, "swiglu_forward");
  const DType t = compute_type({gate.dtype(), up.dtype(), out.dtype()});
  const Tensor g = as_type(gate, t, call), u = as_type(up, t, call);
  StagedOutput o(out, t, call);
  kernels::swiglu_forward(g.data_ptr(), u.data_ptr(), o.data(), t, out.numel(), call.stream);
  o.finish();
}

void CudaBackend::swiglu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up,
                                  Tensor& dgate, Tensor& dup) {
  Call call({&dout, &gate, &up, &dgate, &dup}, "swiglu_backward");
  const DType t =
      compute_type({dout.dtype(), gate.dtype(), up.dtype(), dgate.dtype(), dup.dtype()});
  const Tensor d = as_type(dout, t, call), g = as_type(gate, t, call), u = as_type(up, t, call);
  StagedOutput dg(dgate, t, call), du(dup, t, call);
  kernels::swiglu_backward(d.data_ptr(), g.data_ptr(), u.data_ptr(), dg.data(), du.data(), t,
                           gate.numel(), call.stream);
  dg.finish();
  du.finish();
}

// ---- cross-entropy --------------------------------------------------------------------------

void CudaBackend::cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& losses,
                                        bool targets_checked) {
  Call call({&logits, &targets, &losses}, "cross_entropy_forward");
  require_f32(losses, "cross-entropy losses");
  const int64_t V = logits.size(-1), N = targets.numel();
  if (!targets_checked) check_indices(targets, V, kIgnoreIndex, "target token id", call);
  kernels::cross_entropy_forward(logits.data_ptr(), logits.dtype(),
                                 static_cast<const int64_t*>(targets.data_ptr()),
                                 static_cast<float*>(losses.data_ptr()), N, V, call.stream);
}

void CudaBackend::cross_entropy_backward(const Tensor& logits, const Tensor& targets,
                                         float grad_scale, Tensor& dlogits, bool targets_checked) {
  Call call({&logits, &targets, &dlogits}, "cross_entropy_backward");
  const int64_t V = logits.size(-1), N = targets.numel();
  if (!targets_checked) check_indices(targets, V, kIgnoreIndex, "target token id", call);
  const DType t = compute_type({logits.dtype(), dlogits.dtype()});
  const Tensor lt = as_type(logits, t, call);
  StagedOutput o(dlogits, t, call);
  kernels::cross_entropy_backward(lt.data_ptr(), t, static_cast<const int64_t*>(targets.data_ptr()),
                                  grad_scale, o.data(), N, V, call.stream);
  o.finish();
}

// ---- reductions, optimizer ------------------------------------------------------------------

double CudaBackend::sum(const Tensor& x) {
  Call call({&x}, "sum");
  return kernels::sum(x.data_ptr(), x.dtype(), x.numel(), false, call.scratch, call.stream);
}

double CudaBackend::sum_squares(const Tensor& x) {
  Call call({&x}, "sum_squares");
  return kernels::sum(x.data_ptr(), x.dtype(), x.numel(), true, call.scratch, call.stream);
}

bool CudaBackend::unscale_and_check(Tensor& x, float inv_scale) {
  Call call({&x}, "unscale_and_check");
  return kernels::unscale_and_check(x.data_ptr(), x.dtype(), x.numel(), inv_scale, call.scratch,
                                    call.stream);
}

namespace {

// The tensors of a list as (data, dtype, count) spans, checked to be on the call's GPU.
template <typename TensorPtr>
std::vector<kernels::TensorSpan> spans_on(const std::vector<TensorPtr>& tensors, int device,
                                          const char* op) {
  std::vector<kernels::TensorSpan> spans;
  spans.reserve(tensors.size());
  for (const Tensor* t : tensors) {
    ST_CHECK(device_of({t}, op) == device, "CUDA ", op,
             ": the tensors of one list must be on one GPU (", t->describe(),
             " is not on cuda:", device, ")");
    spans.push_back({t->data_ptr(), t->dtype(), t->numel()});
  }
  return spans;
}

}  // namespace

bool CudaBackend::unscale_and_check_multi(const std::vector<Tensor*>& tensors, float inv_scale) {
  if (tensors.empty()) return false;
  Call call({tensors.front()}, "unscale_and_check_multi");
  const auto spans = spans_on(tensors, call.device, "unscale_and_check_multi");
  return kernels::unscale_and_check_multi(spans.data(), static_cast<int64_t>(spans.size()),
                                          inv_scale, call.scratch, call.stream);
}

std::vector<double> CudaBackend::sum_squares_multi(const std::vector<const Tensor*>& tensors) {
  std::vector<double> out(tensors.size(), 0.0);
  if (tensors.empty()) return out;
  Call call({tensors.front()}, "sum_squares_multi");
  const auto spans = spans_on(tensors, call.device, "sum_squares_multi");
  kernels::sum_squares_multi(spans.data(), static_cast<int64_t>(spans.size()), out.data(),
                             call.scratch, call.stream);
  return out;
}

namespace {

kernels::AdamWConstants adamw_constants(const Backend::AdamWArgs& args) {
  return kernels::adamw_constants(args.lr, args.beta1, args.beta2, args.eps, args.weight_decay,
                                  args.step, args.grad_scale);
}

void require_adamw_operands(const Tensor& param, const Tensor& grad, const Tensor& m,
                            const Tensor& v) {
  require_f32(param, "AdamW parameter");
  require_f32(m, "AdamW first moment");
  require_f32(v, "AdamW second moment");
  // The kernel is built for these gradient dtypes; any other would be left out of the update.
  ST_CHECK_SHAPE(
      grad.dtype() == DType::F32 || grad.dtype() == DType::BF16 || grad.dtype() == DType::F16,
      "CUDA adamw: the gradient must be f32, bf16 or f16, got ", grad.describe());
  ST_CHECK_SHAPE(
      grad.numel() == param.numel() && m.numel() == param.numel() && v.numel() == param.numel(),
      "CUDA adamw: parameter ", param.describe(), ", gradient ", grad.describe(), " and moments ",
      m.describe(), ", ", v.describe(), " must have the same number of elements");
}

}  // namespace

void CudaBackend::adamw(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v,
                        const AdamWArgs& args) {
  adamw_multi({{&param, &grad, &m, &v, true}}, args);  // a list of one
}

void CudaBackend::adamw_multi(const std::vector<AdamWTensor>& tensors, const AdamWArgs& args) {
  if (tensors.empty()) return;
  const AdamWTensor& first = tensors.front();
  Call call({first.param, first.grad, first.m, first.v}, "adamw_multi");
  const kernels::AdamWConstants c = adamw_constants(args);
  // Weight decay is the one constant that differs between tensors; without it the factor is
  // exactly 1 (what adamw_constants forms for weight_decay 0).
  constexpr float kNoDecay = 1.0f;
  std::vector<kernels::AdamWTensorRef> refs;
  refs.reserve(tensors.size());
  for (const AdamWTensor& t : tensors) {
    ST_CHECK(device_of({t.param, t.grad, t.m, t.v}, "adamw_multi") == call.device,
             "CUDA adamw_multi: the tensors of one list must be on one GPU (", t.param->describe(),
             " is not on cuda:", call.device, ")");
    require_adamw_operands(*t.param, *t.grad, *t.m, *t.v);
    refs.push_back({static_cast<float*>(t.param->data_ptr()), t.grad->data_ptr(), t.grad->dtype(),
                    static_cast<float*>(t.m->data_ptr()), static_cast<float*>(t.v->data_ptr()),
                    t.param->numel(), t.decay ? c.decay : kNoDecay});
  }
  kernels::adamw_multi(refs.data(), static_cast<int64_t>(refs.size()), c, call.stream);
}

// ---- registered copy and cast ---------------------------------------------------------------

void copy_between_devices(void* dst, Device dst_device, const void* src, Device src_device,
                          size_t bytes) {
  const int device = dst_device.is_cuda() ? dst_device.index : src_device.index;
  // Between two GPUs the copy runs on the destination's stream, which is not ordered with the
  // source GPU's streams (another context): wait for the work that produces the source first.
  if (dst_device.is_cuda() && src_device.is_cuda() && dst_device.index != src_device.index)
    current_stream(src_device.index).synchronize();
  DeviceGuard guard(device);
  const auto stream = static_cast<cudaStream_t>(current_stream(device).handle());
  ST_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream));
  // Host memory may be read or freed as soon as this returns; device-to-device copies on one
  // GPU are ordered before later work on the stream and need no wait.
  if (!(dst_device == src_device)) ST_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void zero_on_device(void* dst, Device device, size_t bytes) {
  DeviceGuard guard(device.index);
  const auto stream = static_cast<cudaStream_t>(current_stream(device.index).handle());
  ST_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, stream));
}

void cast_on_device(const Tensor& src, Tensor& dst) {
  const int device = dst.device().index;
  DeviceGuard guard(device);
  kernels::cast(src.data_ptr(), src.dtype(), dst.data_ptr(), dst.dtype(), dst.numel(),
                static_cast<cudaStream_t>(current_stream(device).handle()));
}

}  // namespace shardtrain::cuda
