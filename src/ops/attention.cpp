// Causal grouped-query attention: the plain S x S version and the fused (flash-style) one.
#include <cmath>

#include "op_util.h"
#include "shardtrain/ops/ops.h"

namespace shardtrain::ops {

using namespace detail;

namespace {
struct Dims {
  int64_t b, hq, hkv, s, d, group;
};

Dims dims_of(const Tensor& q, const Tensor& k) {
  return {q.size(0), q.size(1), k.size(1), q.size(2), q.size(3), q.size(1) / k.size(1)};
}

// Plain attention, forward and backward: with the heads of one kv group adjacent in memory,
// q[b, group g] is a [G*S, D] matrix, so every product is one strided-batched gemm over B*Hkv
// matrices.
struct PlainAttentionBackward : NamedNode<PlainAttentionBackward> {
  static constexpr const char* kName = "PlainAttentionBackward";
  SavedTensor q, k, v, probs;
  std::vector<Tensor> apply(std::vector<Tensor> g) override {
    Tensor tq = q.unpack(), tk = k.unpack(), tv = v.unpack(), tp = probs.unpack();
    Dims d = dims_of(tq, tk);
    int64_t n = d.b * d.hkv, gs = d.group * d.s;
    float sc = 1.0f / std::sqrt(static_cast<float>(d.d));
    Tensor dprobs = empty(tp.shape(), tp.dtype(), tp.device());
    gemm(g[0], tv, dprobs, false, true, gs, d.s, d.d, n, gs * d.d, d.s * d.d, gs * d.s);
    Tensor dv = empty_like(tv);
    gemm(tp, g[0], dv, true, false, d.s, d.d, gs, n, gs * d.s, gs * d.d, d.s * d.d);
    backend_of(tq).causal_softmax_backward(tp, dprobs, sc, dprobs);
    Tensor dq = empty_like(tq), dk = empty_like(tk);
    gemm(dprobs, tk, dq, false, false, gs, d.d, d.s, n, gs * d.s, d.s * d.d, gs * d.d);
    gemm(dprobs, tq, dk, true, false, d.s, d.d, gs, n, gs * d.s, gs * d.d, d.s * d.d);
    return {dq, dk, dv};
  }
  void release_saved() override {
    q.release();
    k.release();
    v.release();
    probs.release();
  }
};

struct FusedAttentionBackward : NamedNode<FusedAttentionBackward> {
  static constexpr const char* kName = "FusedAttentionBackward";
  SavedTensor q, k, v, out, lse;
  AttentionBackwardAlgo algo = AttentionBackwardAlgo::Deterministic;
  std::vector<Tensor> apply(std::vector<Tensor> g) override {
    Tensor tq = q.unpack(), tk = k.unpack(), tv = v.unpack();
    Tensor dq = empty_like(tq), dk = empty_like(tk), dv = empty_like(tv);
    float sc = 1.0f / std::sqrt(static_cast<float>(tq.size(3)));
    backend_of(tq).attention_backward(tq, tk, tv, out.unpack(), lse.unpack(), g[0], sc, dq, dk, dv,
                                      algo);
    return {dq, dk, dv};
  }
  void release_saved() override {
    q.release();
    k.release();
    v.release();
    out.release();
    lse.release();
  }
};
}  // namespace

AttentionImpl parse_attention_impl(const std::string& name) {
  if (name == "plain") return AttentionImpl::Plain;
  if (name == "fused") return AttentionImpl::Fused;
  throw ConfigError("activation.attention: unknown value '" + name +
                    "': expected plain (S x S scores) or fused (memory-efficient)");
}

Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, AttentionImpl impl,
                 AttentionBackwardAlgo backward) {
  check_same(q, k, "attention");
  check_same(q, v, "attention");
  ST_CHECK_SHAPE(q.dim() == 4 && k.dim() == 4 && k.shape() == v.shape() && q.size(0) == k.size(0) &&
                     q.size(2) == k.size(2) && q.size(3) == k.size(3) && k.size(1) > 0 &&
                     q.size(1) % k.size(1) == 0,
                 "attention: expected q [B, Hq, S, D] and k, v [B, Hkv, S, D] with Hq a multiple "
                 "of Hkv; got q ",
                 q.describe(), ", k ", k.describe(), ", v ", v.describe());
  Dims d = dims_of(q, k);
  float sc = 1.0f / std::sqrt(static_cast<float>(d.d));
  Tensor out = empty_like(q);
  bool graph = autograd::needs_graph({&q, &k, &v});
  if (impl == AttentionImpl::Fused) {
    Tensor lse = empty({d.b, d.hq, d.s}, DType::F32, q.device());
    backend_of(q).attention_forward(q, k, v, sc, out, lse);
    if (graph) {
      auto node = std::make_shared<FusedAttentionBackward>();
      node->q = SavedTensor(q);
      node->k = SavedTensor(k);
      node->v = SavedTensor(v);
      node->out = SavedTensor(out);
      node->lse = SavedTensor(lse);
      node->algo = backward;
      autograd::attach(node, {&q, &k, &v}, {&out});
    }
    return out;
  }
  int64_t n = d.b * d.hkv, gs = d.group * d.s;
  Tensor probs = empty({d.b * d.hq, d.s, d.s}, q.dtype(), q.device());
  // The scores are scaled in the product's fp32 epilogue, before they are stored in the input
  // dtype: a raw fp16 dot product past 65504 would be inf and the row NaN. The backward's
  // gradient is that of the unscaled product (the softmax backward applies the scale).
  gemm(q, k, probs, false, true, gs, d.s, d.d, n, gs * d.d, d.s * d.d, gs * d.s, sc);
  backend_of(q).causal_softmax(probs, 1.0f, probs);
  gemm(probs, v, out, false, false, gs, d.d, d.s, n, gs * d.s, d.s * d.d, gs * d.d);
  if (graph) {
    auto node = std::make_shared<PlainAttentionBackward>();
    node->q = SavedTensor(q);
    node->k = SavedTensor(k);
    node->v = SavedTensor(v);
    node->probs = SavedTensor(probs);
    autograd::attach(node, {&q, &k, &v}, {&out});
  }
  return out;
}

}  // namespace shardtrain::ops
