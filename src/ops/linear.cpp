// linear and batched matmul, both through Backend::gemm.
#include "op_util.h"
#include "shardtrain/ops/ops.h"

namespace shardtrain::ops {

using namespace detail;

namespace {
struct LinearBackward : NamedNode<LinearBackward> {
  static constexpr const char* kName = "LinearBackward";
  SavedTensor x, w;
  bool x_needs_grad = true, w_needs_grad = true;
  std::vector<Tensor> apply(std::vector<Tensor> g) override {
    Tensor tx = x.unpack(), tw = w.unpack();
    int64_t in = tw.size(1), out = tw.size(0), rows = tx.numel() / in;
    Tensor dx, dw;
    if (x_needs_grad) {
      dx = empty(tx.shape(), tx.dtype(), tx.device());
      gemm(g[0], tw, dx, false, false, rows, in, out);  // dy [rows,out] @ W [out,in]
    }
    if (w_needs_grad) {
      dw = empty(tw.shape(), tw.dtype(), tw.device());
      gemm(g[0], tx, dw, true, false, out, in, rows);  // dy^T [out,rows] @ x [rows,in]
    }
    return {dx, dw};
  }
  void release_saved() override {
    x.release();
    w.release();
  }
};

struct MatmulBackward : NamedNode<MatmulBackward> {
  static constexpr const char* kName = "MatmulBackward";
  SavedTensor a, b;
  bool trans_b = false;
  std::vector<Tensor> apply(std::vector<Tensor> g) override {
    Tensor ta = a.unpack(), tb = b.unpack();
    int64_t batch = ta.size(0), m = ta.size(1), k = ta.size(2);
    int64_t n = trans_b ? tb.size(1) : tb.size(2);
    Tensor da = empty_like(ta), db = empty_like(tb);
    // dA [m,k] = dC [m,n] @ op(B)^T
    gemm(g[0], tb, da, false, !trans_b, m, k, n, batch, m * n, k * n, m * k);
    if (trans_b)  // B stored [n,k]: dB = dC^T [n,m] @ A [m,k]
      gemm(g[0], ta, db, true, false, n, k, m, batch, m * n, m * k, n * k);
    else  // B stored [k,n]: dB = A^T [k,m] @ dC [m,n]
      gemm(ta, g[0], db, true, false, k, n, m, batch, m * k, m * n, k * n);
    return {da, db};
  }
  void release_saved() override {
    a.release();
    b.release();
  }
};
}  // namespace

Tensor linear(const Tensor& x, const Tensor& w) {
  check_float(x, "linear", "input");
  check_same(x, w, "linear");
  ST_CHECK_SHAPE(w.dim() == 2 && w.size(1) > 0 && x.dim() >= 1 && x.size(-1) == w.size(1),
                 "linear: input ", x.describe(), " does not match weight ", w.describe(),
                 " (expected input [..., ", w.dim() == 2 ? w.size(1) : -1,
                 "] and at least one input feature)");
  int64_t in = w.size(1), out_features = w.size(0), rows = x.numel() / in;
  Shape out_shape = x.shape();
  out_shape.back() = out_features;
  Tensor out = empty(out_shape, x.dtype(), x.device());
  gemm(x, w, out, false, true, rows, out_features, in);
  if (autograd::needs_graph({&x, &w})) {
    auto node = std::make_shared<LinearBackward>();
    node->x_needs_grad = autograd::requires_grad(x);
    node->w_needs_grad = autograd::requires_grad(w);
    node->x = SavedTensor(x);
    node->w = SavedTensor(w);
    autograd::attach(node, {&x, &w}, {&out});
  }
  return out;
}

Tensor matmul(const Tensor& a, const Tensor& b, bool trans_b) {
  check_same(a, b, "matmul");
  ST_CHECK_SHAPE(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0), "matmul: ", a.describe(),
                 " @ ", b.describe(), ": expected [batch, m, k] @ [batch, k, n]");
  int64_t batch = a.size(0), m = a.size(1), k = a.size(2);
  int64_t kb = trans_b ? b.size(2) : b.size(1), n = trans_b ? b.size(1) : b.size(2);
  ST_CHECK_SHAPE(k == kb, "matmul: inner dimensions differ: ", a.describe(), " @ ", b.describe(),
                 trans_b ? "^T" : "");
  Tensor out = empty({batch, m, n}, a.dtype(), a.device());
  gemm(a, b, out, false, trans_b, m, n, k, batch, m * k, k * n, m * n);
  if (autograd::needs_graph({&a, &b})) {
    auto node = std::make_shared<MatmulBackward>();
    node->a = SavedTensor(a);
    node->b = SavedTensor(b);
    node->trans_b = trans_b;
    autograd::attach(node, {&a, &b}, {&out});
  }
  return out;
}

}  // namespace shardtrain::ops
