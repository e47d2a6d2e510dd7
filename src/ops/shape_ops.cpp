// reshape, swap_dims_12, cast, slice_rows.
#include "op_util.h"
#include "shardtrain/ops/ops.h"

namespace shardtrain::ops {

using namespace detail;

namespace {
struct ReshapeBackward : NamedNode<ReshapeBackward> {
  static constexpr const char* kName = "ReshapeBackward";
  Shape input_shape;
  std::vector<Tensor> apply(std::vector<Tensor> g) override { return {g[0].view(input_shape)}; }
};

struct SwapDimsBackward : NamedNode<SwapDimsBackward> {
  static constexpr const char* kName = "SwapDims12Backward";
  std::vector<Tensor> apply(std::vector<Tensor> g) override { return {swap_dims_12(g[0])}; }
};

struct CastBackward : NamedNode<CastBackward> {
  static constexpr const char* kName = "CastBackward";
  DType input_dtype;
  std::vector<Tensor> apply(std::vector<Tensor> g) override { return {cast(g[0], input_dtype)}; }
};

struct SliceRowsBackward : NamedNode<SliceRowsBackward> {
  static constexpr const char* kName = "SliceRowsBackward";
  Shape input_shape;
  int64_t start = 0;
  std::vector<Tensor> apply(std::vector<Tensor> g) override {
    Tensor full = zeros(input_shape, g[0].dtype(), g[0].device());
    Tensor rows = full.slice_rows(start, g[0].size(0));
    rows.copy_from(g[0]);
    return {full};
  }
};
}  // namespace

Tensor reshape(const Tensor& x, Shape shape) {
  Tensor out = x.view(std::move(shape));
  if (autograd::needs_graph({&x})) {
    auto node = std::make_shared<ReshapeBackward>();
    node->input_shape = x.shape();
    autograd::attach(node, {&x}, {&out});
  }
  return out;
}

Tensor swap_dims_12(const Tensor& x) {
  ST_CHECK_SHAPE(x.dim() == 4, "swap_dims_12 needs a 4-d tensor, got ", x.describe());
  Tensor out = empty({x.size(0), x.size(2), x.size(1), x.size(3)}, x.dtype(), x.device());
  backend_of(x).permute_0213(x, out);
  if (autograd::needs_graph({&x}))
    autograd::attach(std::make_shared<SwapDimsBackward>(), {&x}, {&out});
  return out;
}

Tensor cast(const Tensor& x, DType dtype) {
  if (x.dtype() == dtype) return x;
  Tensor out = empty(x.shape(), dtype, x.device());
  backend_of(x).cast(x, out);
  if (autograd::needs_graph({&x})) {
    auto node = std::make_shared<CastBackward>();
    node->input_dtype = x.dtype();
    autograd::attach(node, {&x}, {&out});
  }
  return out;
}

Tensor slice_rows(const Tensor& x, int64_t start, int64_t length) {
  Tensor out = x.slice_rows(start, length).clone();
  if (autograd::needs_graph({&x})) {
    auto node = std::make_shared<SliceRowsBackward>();
    node->input_shape = x.shape();
    node->start = start;
    autograd::attach(node, {&x}, {&out});
  }
  return out;
}

}  // namespace shardtrain::ops
