// add, mul, scale, mul_lastdim.
#include "op_util.h"
#include "shardtrain/ops/ops.h"

namespace shardtrain::ops {

using namespace detail;

namespace {
struct AddBackward : NamedNode<AddBackward> {
  static constexpr const char* kName = "AddBackward";
  std::vector<Tensor> apply(std::vector<Tensor> g) override { return {g[0], g[0]}; }
};

struct MulBackward : NamedNode<MulBackward> {
  static constexpr const char* kName = "MulBackward";
  SavedTensor a, b;
  std::vector<Tensor> apply(std::vector<Tensor> g) override {
    Tensor ta = a.unpack(), tb = b.unpack();
    Tensor da = empty_like(ta), db = empty_like(tb);
    backend_of(g[0]).mul(g[0], tb, da);
    backend_of(g[0]).mul(g[0], ta, db);
    return {da, db};
  }
  void release_saved() override {
    a.release();
    b.release();
  }
};

struct ScaleBackward : NamedNode<ScaleBackward> {
  static constexpr const char* kName = "ScaleBackward";
  float factor = 1.0f;
  std::vector<Tensor> apply(std::vector<Tensor> g) override {
    Tensor d = empty_like(g[0]);
    backend_of(g[0]).scale(g[0], d, factor);
    return {d};
  }
};

struct MulLastdimBackward : NamedNode<MulLastdimBackward> {
  static constexpr const char* kName = "MulLastdimBackward";
  SavedTensor x, w;
  std::vector<Tensor> apply(std::vector<Tensor> g) override {
    Tensor tx = x.unpack(), tw = w.unpack();
    Tensor dx = empty_like(tx);
    backend_of(tx).mul_lastdim(g[0], tw, dx);
    Tensor dw = zeros(tw.shape(), DType::F32, tw.device());
    backend_of(tx).mul_lastdim_backward_weight(g[0], tx, dw);
    return {dx, in_dtype(dw, tw.dtype())};
  }
  void release_saved() override {
    x.release();
    w.release();
  }
};
}  // namespace

Tensor add(const Tensor& a, const Tensor& b) {
  check_same(a, b, "add");
  ST_CHECK_SHAPE(a.shape() == b.shape(), "add: shapes differ (", a.describe(), " vs ", b.describe(),
                 ")");
  Tensor out = empty_like(a);
  backend_of(a).add(a, b, out, 1.0f, 1.0f);
  if (autograd::needs_graph({&a, &b}))
    autograd::attach(std::make_shared<AddBackward>(), {&a, &b}, {&out});
  return out;
}

Tensor mul(const Tensor& a, const Tensor& b) {
  check_same(a, b, "mul");
  ST_CHECK_SHAPE(a.shape() == b.shape(), "mul: shapes differ (", a.describe(), " vs ", b.describe(),
                 ")");
  Tensor out = empty_like(a);
  backend_of(a).mul(a, b, out);
  if (autograd::needs_graph({&a, &b})) {
    auto node = std::make_shared<MulBackward>();
    node->a = SavedTensor(a);
    node->b = SavedTensor(b);
    autograd::attach(node, {&a, &b}, {&out});
  }
  return out;
}

Tensor scale(const Tensor& x, float factor) {
  Tensor out = empty_like(x);
  backend_of(x).scale(x, out, factor);
  if (autograd::needs_graph({&x})) {
    auto node = std::make_shared<ScaleBackward>();
    node->factor = factor;
    autograd::attach(node, {&x}, {&out});
  }
  return out;
}

Tensor mul_lastdim(const Tensor& x, const Tensor& w) {
  check_same(x, w, "mul_lastdim");
  ST_CHECK_SHAPE(w.dim() == 1 && x.size(-1) == w.size(0), "mul_lastdim: ", x.describe(), " * ",
                 w.describe());
  Tensor out = empty_like(x);
  backend_of(x).mul_lastdim(x, w, out);
  if (autograd::needs_graph({&x, &w})) {
    auto node = std::make_shared<MulLastdimBackward>();
    node->x = SavedTensor(x);
    node->w = SavedTensor(w);
    autograd::attach(node, {&x, &w}, {&out});
  }
  return out;
}

}  // namespace shardtrain::ops
