#include "shardtrain/activation/estimate.h"

#include <algorithm>
#include <vector>

#include "shardtrain/activation/strategy.h"

namespace shardtrain::activation {

namespace {

// Allocations are counted in 64-byte units.
int64_t r64(int64_t bytes) {
  return (std::max<int64_t>(bytes, 1) + 63) / 64 * 64;
}

// The sizes of one decoder layer's tensors (B batch, S sequence, T = B*S tokens, e bytes per
// element) and the derived quantities the formulas use.
struct LayerSizes {
  bool plain = true;
  int64_t X = 0;    // [T, hidden]: layer input, norm outputs, q, attention output, residuals
  int64_t KV = 0;   // [T, kv_heads * head_dim]: k, v
  int64_t M = 0;    // [T, intermediate]: gate, up, swiglu output
  int64_t R = 0;    // f32 [T]: rms_norm's rstd
  int64_t P = 0;    // [B*heads, S, S]: plain attention probabilities
  int64_t LSE = 0;  // f32 [B, heads, S]: fused attention log-sum-exp

  // What the ops of one layer save (distinct tensors; weights are Parameters, not counted):
  // rms_norm x, rstd | q/k/v_proj their shared input | attention q, k, v + probs (plain) or
  // out, lse (fused) | o_proj its input | rms_norm h, rstd | gate/up_proj their shared input |
  // swiglu gate, up | down_proj its input. rope, swap_dims_12, reshape and add save nothing.
  std::vector<int64_t> saved() const {
    std::vector<int64_t> s = {X, R, X, X, KV, KV};
    if (plain) {
      s.push_back(P);
    } else {
      s.push_back(X);
      s.push_back(LSE);
    }
    for (int64_t b : {X, X, R, X, M, M, M}) s.push_back(b);
    return s;
  }
  int64_t saved_total() const {
    int64_t t = 0;
    for (int64_t b : saved()) t += b;
    return t;
  }
  // The attention op's transient beyond its output: the probabilities or the log-sum-exp.
  int64_t attn_scratch() const { return plain ? P : LSE; }
  // What selective checkpointing stops keeping: the core's saves other than q, k, v.
  int64_t core_saved() const { return plain ? P : X + LSE; }
  // Saved before the attention core runs: x, rstd, the norm output, q, k, v.
  int64_t before_core() const { return 3 * X + R + 2 * KV; }
  // A layer's forward when nothing is kept (inside a region, or offloaded): the most that is
  // alive at once, its input included. The moments: the attention op (x, norm output, q, k, v,
  // output, probabilities or lse); o_proj (x, norm output, q, k, v, attention output, its
  // transpose, o_proj output); down_proj (x, h, norm output, gate, up, swiglu, down output); the
  // final residual add (x, h, norm output, down output, sum).
  int64_t forward_working_set() const {
    return std::max({4 * X + 2 * KV + attn_scratch(), 6 * X + 2 * KV, 4 * X + 3 * M, 5 * X});
  }
  // A region's re-run of n layers beyond its kept input: every saved tensor but that input, plus
  // the last down_proj output, allocated when the re-run stops (non-reentrant); the reentrant
  // re-run runs to the end and also holds the region's output.
  int64_t rerun(int64_t n, bool reentrant) const { return n * saved_total() + (reentrant ? X : 0); }
};

LayerSizes layer_sizes(int64_t batch, int64_t seq, int64_t hidden, int64_t heads, int64_t kv_heads,
                       int64_t intermediate, int64_t e, ops::AttentionImpl impl) {
  ST_CHECK_AS(ConfigError,
              batch > 0 && seq > 0 && hidden > 0 && heads > 0 && kv_heads > 0 && intermediate > 0 &&
                  e > 0 && hidden % heads == 0,
              "activation estimate: batch, seq, hidden, heads, kv_heads, intermediate and dtype "
              "bytes must be positive with heads dividing hidden; got batch ",
              batch, ", seq ", seq, ", hidden ", hidden, ", heads ", heads, ", kv_heads ", kv_heads,
              ", intermediate ", intermediate, ", dtype bytes ", e);
  int64_t t = batch * seq, d = hidden / heads;
  LayerSizes s;
  s.plain = impl == ops::AttentionImpl::Plain;
  s.X = r64(t * hidden * e);
  s.KV = r64(t * kv_heads * d * e);
  s.M = r64(t * intermediate * e);
  s.R = r64(4 * t);
  s.P = r64(batch * heads * seq * seq * e);
  s.LSE = r64(4 * batch * heads * seq);
  return s;
}

int64_t small_saved(const LayerSizes& s, int64_t min_bytes) {
  int64_t small = 0;
  for (int64_t b : s.saved())
    if (b < min_bytes) small += b;
  return small;
}

int64_t per_layer_bytes(const std::string& strategy, const LayerSizes& s, int64_t min_bytes) {
  check_strategy(strategy);
  if (strategy == "none") return s.saved_total();
  if (strategy == "per_layer" || strategy == "sqrt_segment") return s.X;
  if (strategy == "selective") return s.saved_total() - s.core_saved();
  if (strategy == "offload") return small_saved(s, min_bytes);
  return s.X < min_bytes ? s.X : 0;  // offload_checkpoint
}

}  // namespace

int64_t activation_bytes_per_layer(const std::string& strategy, int64_t batch, int64_t seq,
                                   int64_t hidden, int64_t heads, int64_t kv_heads,
                                   int64_t intermediate, int64_t dtype_bytes,
                                   ops::AttentionImpl attention_impl, int64_t offload_min_bytes) {
  LayerSizes s =
      layer_sizes(batch, seq, hidden, heads, kv_heads, intermediate, dtype_bytes, attention_impl);
  return per_layer_bytes(strategy, s, offload_min_bytes);
}

int64_t head_logit_bytes(int64_t tokens, int64_t vocab, int64_t dtype_bytes, int64_t loss_chunk) {
  const int64_t rows = loss_chunk > 0 ? std::min(loss_chunk, tokens) : tokens;
  return r64(rows * vocab * dtype_bytes);
}

ActivationEstimate activation_bytes_model(const std::string& strategy,
                                          const ActivationModelShape& m, bool reentrant,
                                          int64_t min_bytes) {
  LayerSizes s = layer_sizes(m.batch, m.seq, m.hidden, m.heads, m.kv_heads, m.intermediate,
                             m.dtype_bytes, m.attention_impl);
  ST_CHECK_AS(ConfigError, m.layers > 0 && m.vocab > 0,
              "activation estimate: layers and vocab must be positive");
  const int64_t L = m.layers, t = m.batch * m.seq;
  const int64_t scalar = 64;              // the loss (an f32 [1]), or backward's seed
  const int64_t inputs = 2 * r64(8 * t);  // int64 ids and targets
  ST_CHECK_AS(ConfigError, m.loss_chunk >= 0, "activation estimate: loss_chunk must be >= 0");
  const int64_t logits = head_logit_bytes(t, m.vocab, m.dtype_bytes, 0);
  // The head keeps the last layer's output, the final norm's output and rstd, and the logits;
  // while the loss is computed, a per-row f32 loss vector and the scalar exist as well. A
  // chunked loss keeps no logits: one chunk's exist while its losses are computed.
  const int64_t head_saved = 2 * s.X + s.R + (m.loss_chunk > 0 ? 0 : logits);
  const int64_t head_peak =
      head_saved + r64(4 * t) +
      (m.loss_chunk > 0 ? head_logit_bytes(t, m.vocab, m.dtype_bytes, m.loss_chunk) : scalar);
  const int64_t sl = s.saved_total();
  const int64_t work = s.forward_working_set();

  ActivationEstimate e;
  e.per_layer = per_layer_bytes(strategy, s, min_bytes);
  int64_t kept = 0, fwd = 0, bwd = 0;  // kept: all layers' bytes when forward returns

  bool offload_input = strategy == "offload_checkpoint" && s.X >= min_bytes;
  if (strategy == "none") {
    kept = L * sl;
    fwd = kept + head_peak;
  } else if (strategy == "per_layer" || (strategy == "offload_checkpoint" && !offload_input)) {
    kept = L * s.X;
    fwd = std::max((L - 1) * s.X + work, kept + head_peak);
    bwd = L * s.X + scalar + s.rerun(1, reentrant);  // the last layer's re-run
  } else if (strategy == "sqrt_segment") {
    auto segments = sqrt_segments(static_cast<int>(L), nullptr);
    kept = static_cast<int64_t>(segments.size()) * s.X;
    fwd = kept + head_peak;
    for (size_t j = 0; j < segments.size(); ++j) {
      auto [first, last] = segments[j];
      // Inside the segment's layers: earlier segments' inputs, plus this one's after its first
      // layer (in the first layer it is that layer's own input).
      for (int l = first; l <= last; ++l)
        fwd = std::max(fwd, static_cast<int64_t>(j + (l > first ? 1 : 0)) * s.X + work);
      int64_t n = last - first + 1;
      bwd = std::max(bwd, static_cast<int64_t>(j + 1) * s.X + scalar + s.rerun(n, reentrant));
    }
  } else if (strategy == "selective") {
    int64_t kept_layer = sl - s.core_saved();
    kept = L * kept_layer;
    int64_t before = (L - 1) * kept_layer + s.before_core();  // the last layer, at its core
    fwd = std::max({before + s.X + s.attn_scratch(),  // the core: output and probabilities / lse
                    before + 3 * s.X,                 // o_proj: core output, transpose, result
                    kept + 2 * s.X,                   // the last residual add
                    kept + head_peak});
    // The last layer's core re-run: its output and probabilities (plain) or lse (fused).
    bwd = before + scalar + s.X + s.attn_scratch();
  } else if (strategy == "offload") {
    int64_t small = small_saved(s, min_bytes), large = sl - small;
    kept = L * small;
    e.host_bytes = L * large;
    fwd = kept + std::max(work, head_peak);
    // Backward of layer i holds layer i (prefetched while layer i+1 ran) and prefetches layer
    // i-1: two layers at once (exact for three layers or more, a bound below that).
    bwd = kept + scalar + std::min<int64_t>(L, 2) * large;
  } else {  // offload_checkpoint with the input in the host pool
    e.host_bytes = L * s.X;
    fwd = std::max(work, head_peak);
    // Layer i's input restored, layer i-1's prefetched, and layer i re-run.
    bwd = std::min<int64_t>(L, 2) * s.X + scalar + s.rerun(1, reentrant);
  }
  e.after_forward = inputs + kept + head_saved + scalar;
  e.forward_peak = inputs + fwd;
  // Backward starts with everything forward left plus the seed gradient.
  e.backward_peak = std::max(e.after_forward + scalar, inputs + bwd);
  e.peak = std::max(e.forward_peak, e.backward_peak);
  return e;
}

}  // namespace shardtrain::activation
