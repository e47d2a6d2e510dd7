// embedding, rms_norm, rope, swiglu.
#include "op_util.h"
#include "shardtrain/ops/ops.h"

namespace shardtrain::ops {

using namespace detail;

namespace {
struct EmbeddingBackward : NamedNode<EmbeddingBackward> {
  static constexpr const char* kName = "EmbeddingBackward";
  SavedTensor ids;
  Shape weight_shape;
  DType weight_dtype;
  std::vector<Tensor> apply(std::vector<Tensor> g) override {
    Tensor tids = ids.unpack();
    Tensor dw = zeros(weight_shape, DType::F32, g[0].device());
    backend_of(g[0]).embedding_backward(g[0].view({tids.numel(), weight_shape[1]}),
                                        tids.view({tids.numel()}), dw);
    return {in_dtype(dw, weight_dtype), Tensor()};
  }
  void release_saved() override { ids.release(); }
};

struct RmsNormBackward : NamedNode<RmsNormBackward> {
  static constexpr const char* kName = "RmsNormBackward";
  SavedTensor x, w, rstd;
  std::vector<Tensor> apply(std::vector<Tensor> g) override {
    Tensor tx = x.unpack(), tw = w.unpack(), tr = rstd.unpack();
    int64_t h = tw.size(0), rows = tx.numel() / h;
    Tensor dx = empty_like(tx);
    Tensor dw = zeros({h}, DType::F32, tx.device());
    Tensor dx2 = dx.view({rows, h});
    backend_of(tx).rmsnorm_backward(g[0].view({rows, h}), tx.view({rows, h}), tw, tr, dx2, dw);
    return {dx, in_dtype(dw, tw.dtype())};
  }
  void release_saved() override {
    x.release();
    w.release();
    rstd.release();
  }
};

struct RopeBackward : NamedNode<RopeBackward> {
  static constexpr const char* kName = "RopeBackward";
  RopeParams params;
  int64_t offset = 0;
  std::vector<Tensor> apply(std::vector<Tensor> g) override {
    Tensor dx = empty_like(g[0]);
    backend_of(g[0]).rope(g[0], dx, params, offset, /*inverse=*/true);
    return {dx};
  }
};

struct SwigluBackward : NamedNode<SwigluBackward> {
  static constexpr const char* kName = "SwigluBackward";
  SavedTensor gate, up;
  std::vector<Tensor> apply(std::vector<Tensor> g) override {
    Tensor tg = gate.unpack(), tu = up.unpack();
    Tensor dg = empty_like(tg), du = empty_like(tu);
    backend_of(tg).swiglu_backward(g[0], tg, tu, dg, du);
    return {dg, du};
  }
  void release_saved() override {
    gate.release();
    up.release();
  }
};
}  // namespace

Tensor embedding(const Tensor& weight, const Tensor& ids) {
  check_float(weight, "embedding", "weight");
  ST_CHECK_SHAPE(weight.dim() == 2, "embedding: weight must be [vocab, hidden], got ",
                 weight.describe());
  ST_CHECK_SHAPE(ids.dtype() == DType::I64, "embedding: ids must be int64, got ", ids.describe());
  Shape out_shape = ids.shape();
  out_shape.push_back(weight.size(1));
  Tensor out = empty(out_shape, weight.dtype(), weight.device());
  Tensor flat = out.view({ids.numel(), weight.size(1)});
  backend_of(weight).embedding_forward(weight, ids.view({ids.numel()}), flat);
  if (autograd::needs_graph({&weight})) {
    auto node = std::make_shared<EmbeddingBackward>();
    node->ids = SavedTensor(ids);
    node->weight_shape = weight.shape();
    node->weight_dtype = weight.dtype();
    autograd::attach(node, {&weight, &ids}, {&out});
  }
  return out;
}

Tensor rms_norm(const Tensor& x, const Tensor& w, float eps) {
  check_same(x, w, "rms_norm");
  ST_CHECK_SHAPE(w.dim() == 1 && w.size(0) > 0 && x.size(-1) == w.size(0), "rms_norm: input ",
                 x.describe(), " does not match weight ", w.describe(), " (of at least 1 element)");
  int64_t h = w.size(0), rows = x.numel() / h;
  Tensor y = empty_like(x);
  Tensor rstd = empty({rows}, DType::F32, x.device());
  Tensor y2 = y.view({rows, h});
  backend_of(x).rmsnorm_forward(x.view({rows, h}), w, eps, y2, rstd);
  if (autograd::needs_graph({&x, &w})) {
    auto node = std::make_shared<RmsNormBackward>();
    node->x = SavedTensor(x);
    node->w = SavedTensor(w);
    node->rstd = SavedTensor(rstd);
    autograd::attach(node, {&x, &w}, {&y});
  }
  return y;
}

Tensor rope(const Tensor& x, const RopeParams& params, int64_t position_offset) {
  check_float(x, "rope", "input");
  ST_CHECK_SHAPE(x.dim() == 4 && x.size(3) % 2 == 0, "rope: expected [batch, seq, heads, dim] ",
                 "with an even dim, got ", x.describe());
  Tensor out = empty_like(x);
  backend_of(x).rope(x, out, params, position_offset, false);
  if (autograd::needs_graph({&x})) {
    auto node = std::make_shared<RopeBackward>();
    node->params = params;
    node->offset = position_offset;
    autograd::attach(node, {&x}, {&out});
  }
  return out;
}

Tensor swiglu(const Tensor& gate, const Tensor& up) {
  check_same(gate, up, "swiglu");
  ST_CHECK_SHAPE(gate.shape() == up.shape(), "swiglu: gate ", gate.describe(), " and up ",
                 up.describe(), " differ");
  Tensor out = empty_like(gate);
  backend_of(gate).swiglu_forward(gate, up, out);
  if (autograd::needs_graph({&gate, &up})) {
    auto node = std::make_shared<SwigluBackward>();
    node->gate = SavedTensor(gate);
    node->up = SavedTensor(up);
    autograd::attach(node, {&gate, &up}, {&out});
  }
  return out;
}

}  // namespace shardtrain::ops
