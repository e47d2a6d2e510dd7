// Mixed-precision training with fp32 master weights (PyTorch FSDP MixedPrecision semantics).
//
// The model's parameter slots hold fp32 master weights; the optimizer updates those. Around the
// forward of each unit (every decoder layer, and the root unit: embeddings, final norm, head) the
// slots are swapped for compute copies `ops::cast(master, param_dtype)` and the masters are put
// back afterwards. Because ops output the dtype of their inputs, the embedding output is already
// in the compute dtype, so the whole activation path (residual stream, attention, MLP, logits)
// runs in 16-bit storage with fp32 math inside every kernel. Gradients flow back through each
// cast's backward, which casts them to fp32 into the master's .grad.
//
// Training-step order with a GradScaler (see grad_scaler.h):
//   loss = ops::scale(model.loss_sum(...), scaler.scale() / total_counted_tokens)
//   autograd::backward(loss)            (once per micro-batch; gradients accumulate)
//   found_inf = scaler.unscale_and_check(params)    before clipping, once per step
//   clip, then optimizer.step(lr) only when !found_inf
//   scaler.update(found_inf)
// docs/mixed-precision.md describes the dtypes, loss scaling and the token-weighted loss.
#pragma once
#include "shardtrain/core/dtype.h"
#include "shardtrain/nn/llama.h"

namespace shardtrain::amp {

struct PrecisionPolicy {
  // Dtype of the compute copies of the parameters, and therefore of activations and logits.
  // F32 installs no swapping (plain fp32 training).
  DType param_dtype = DType::F32;
  // Dtype gradients are communicated in. Single-process there is no communication, so each
  // backward's incoming gradient of a master is rounded through this dtype before it is added to
  // the fp32 .grad: the master gradient holds exactly the values an all-reduce / reduce-scatter in
  // this dtype would have delivered (for one rank), accumulated over micro-batches in fp32.
  DType reduce_dtype = DType::F32;

  bool operator==(const PrecisionPolicy&) const = default;
};

// Installs the policy on `model` (once, before training). When param_dtype is not F32 it adds a
// model wrapper (root unit: its compute copies stay swapped in for the whole forward, since the
// head runs last) and a layer wrapper (one decoder layer's parameters around that layer's
// forward). Compute copies are allocated as Parameters memory and live as long as a backward
// node saves them. Only F32 floating slots are cast, so frozen or quantized parameters already
// in another dtype are left alone.
//
// Wrapper order: the first wrapper added is the outermost, so install this after activation
// checkpointing and parameter gathering: a recompute then re-casts the parameters, and the cast
// sees the gathered weights.
//
// When reduce_dtype is not F32 it registers a gradient hook on every master that requires a
// gradient, rounding each incoming gradient through reduce_dtype.
//
// Throws ConfigError when either dtype is not a floating type.
void install_mixed_precision(nn::LlamaModel& model, const PrecisionPolicy& policy);

}  // namespace shardtrain::amp
