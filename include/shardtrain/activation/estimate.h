// Predicted activation memory of a LlamaModel training step under each strategy, counted from
// what this implementation's ops save and allocate (docs/activation-memory.md derives every term).
// Figures are device bytes counted under MemoryCategory::Activations, each allocation rounded up
// to the allocators' 64-byte granularity.
#pragma once
#include <cstdint>
#include <string>

#include "shardtrain/ops/ops.h"

namespace shardtrain::activation {

// Bytes one decoder layer keeps on the device between its forward and its backward:
//   none                 everything its ops save
//   per_layer            its input
//   sqrt_segment         its input if it starts a segment (the figure returned), else nothing
//   selective            everything but what the attention core saves beyond q, k, v
//   offload              saved tensors smaller than offload_min_bytes
//   offload_checkpoint   nothing (its input is in the host pool) unless the input is smaller
//                        than offload_min_bytes
// Throws ConfigError for an unknown strategy.
int64_t activation_bytes_per_layer(const std::string& strategy, int64_t batch, int64_t seq,
                                   int64_t hidden, int64_t heads, int64_t kv_heads,
                                   int64_t intermediate, int64_t dtype_bytes,
                                   ops::AttentionImpl attention_impl,
                                   int64_t offload_min_bytes = 0);

// Bytes of the head's logits that exist at once on `tokens` rows: all [tokens, vocab] of them,
// or, with a chunked loss (loss_chunk > 0), one chunk's (its forward, and its backward, which
// computes them again).
int64_t head_logit_bytes(int64_t tokens, int64_t vocab, int64_t dtype_bytes, int64_t loss_chunk);

struct ActivationModelShape {
  int64_t batch = 1;
  int64_t seq = 1;
  int64_t hidden = 64;
  int64_t heads = 4;
  int64_t kv_heads = 4;
  int64_t intermediate = 176;
  int64_t vocab = 256;
  int64_t layers = 2;
  int64_t dtype_bytes = 4;
  ops::AttentionImpl attention_impl = ops::AttentionImpl::Plain;
  // Rows per chunk of the fused head + loss (LlamaModel::set_loss_chunk_rows); 0 = the logits
  // are materialised whole and saved for backward.
  int64_t loss_chunk = 0;
};

// One step (LlamaModel::loss_sum, then autograd::backward on the loss) with the strategy applied
// to every layer. Included: the input ids and targets (the embedding and the loss keep them), the
// embedding output, every layer's saved tensors, the head's (final-norm input and output, its
// rstd, the logits unless the loss is chunked), the loss and the temporaries of the moment each
// peak happens; in backward the re-run of a region, restored and prefetched tensors, and the loss
// scalar and seed gradient. Not included: parameters, gradients and Workspace (backward's transient
// gradients, kernel scratch), which other categories count.
struct ActivationEstimate {
  int64_t per_layer = 0;      // activation_bytes_per_layer
  int64_t after_forward = 0;  // in use when loss_sum returns (the loss included)
  int64_t forward_peak = 0;
  int64_t backward_peak = 0;
  int64_t peak = 0;        // max of the two
  int64_t host_bytes = 0;  // in the host pool (Offloaded) when forward returns
};

ActivationEstimate activation_bytes_model(const std::string& strategy,
                                          const ActivationModelShape& shape, bool reentrant = false,
                                          int64_t offload_min_bytes = 0);

}  // namespace shardtrain::activation
