// Helpers shared by the op implementations (private to the ops layer).
#pragma once
#include <memory>
#include <vector>

#include "shardtrain/autograd/node.h"
#include "shardtrain/backend/backend.h"

namespace shardtrain::ops::detail {

using autograd::SavedTensor;

inline Backend& backend_of(const Tensor& t) {
  return backend_for(t.device());
}

inline Tensor empty_like(const Tensor& t) {
  return empty(t.shape(), t.dtype(), t.device());
}

inline void check_float(const Tensor& t, const char* op, const char* what) {
  ST_CHECK_SHAPE(t.defined(), op, ": ", what, " is undefined");
  ST_CHECK_SHAPE(is_floating(t.dtype()), op, ": ", what, " must be a floating tensor, got ",
                 t.describe());
}

inline void check_same(const Tensor& a, const Tensor& b, const char* op) {
  ST_CHECK_SHAPE(a.dtype() == b.dtype(), op, ": dtypes differ (", a.describe(), " vs ",
                 b.describe(), "); cast one of them first");
  ST_CHECK_SHAPE(a.device() == b.device(), op, ": devices differ (", a.describe(), " vs ",
                 b.describe(), ")");
}

// An f32 accumulator for a weight gradient, returned in the weight's dtype.
inline Tensor in_dtype(Tensor g, DType dtype) {
  return g.dtype() == dtype ? g : g.to(dtype);
}

// C = alpha op(A) @ op(B) over `batch` matrices with element strides between them (GemmArgs).
inline void gemm(const Tensor& a, const Tensor& b, Tensor& c, bool ta, bool tb, int64_t m,
                 int64_t n, int64_t k, int64_t batch = 1, int64_t sa = 0, int64_t sb = 0,
                 int64_t sc = 0, float alpha = 1.0f) {
  GemmArgs args;
  args.alpha = alpha;
  args.trans_a = ta;
  args.trans_b = tb;
  args.m = m;
  args.n = n;
  args.k = k;
  args.batch = batch;
  args.stride_a = sa;
  args.stride_b = sb;
  args.stride_c = sc;
  backend_of(a).gemm(args, a, b, c);
}

// A Node with a fixed name and a lambda-free apply; ops subclass it.
template <typename Derived>
struct NamedNode : autograd::Node {
  std::string name() const override { return Derived::kName; }
};

}  // namespace shardtrain::ops::detail
