// Summed cross-entropy with ignored targets, and reductions.
#include "op_util.h"
#include "shardtrain/ops/ops.h"

namespace shardtrain::ops {

using namespace detail;

namespace {
struct CrossEntropyBackward : NamedNode<CrossEntropyBackward> {
  static constexpr const char* kName = "CrossEntropyBackward";
  SavedTensor logits, targets;
  std::vector<Tensor> apply(std::vector<Tensor> g) override {
    Tensor tl = logits.unpack();
    float upstream = g[0].item();
    Tensor dl = empty_like(tl);
    // The forward checked the targets on the host (cross_entropy_sum).
    backend_of(tl).cross_entropy_backward(tl, targets.unpack(), upstream, dl, true);
    return {dl, Tensor()};
  }
  void release_saved() override {
    logits.release();
    targets.release();
  }
};

// The head's logits of rows [start, start + rows): x[start:start+rows] @ w^T into `logits`.
void chunk_logits(const Tensor& x, const Tensor& w, int64_t start, int64_t rows, Tensor& logits) {
  const int64_t hidden = w.size(1), vocab = w.size(0);
  GemmArgs args;
  args.trans_b = true;
  args.m = rows;
  args.n = vocab;
  args.k = hidden;
  args.offset_a = start * hidden;
  backend_of(x).gemm(args, x, w, logits);
}

struct LinearCrossEntropyBackward : NamedNode<LinearCrossEntropyBackward> {
  static constexpr const char* kName = "LinearCrossEntropyBackward";
  SavedTensor x, w, targets;
  int64_t chunk_rows = 0;
  bool x_needs_grad = true, w_needs_grad = true;
  // Chunk by chunk: the logits again (the recompute that replaces keeping them), the gradient
  // softmax - onehot written over them, then its two products. d(w) sums over the chunks in
  // fp32 and is rounded once into w's dtype, as one matrix product over all rows would round.
  std::vector<Tensor> apply(std::vector<Tensor> g) override {
    Tensor tx = x.unpack(), tw = w.unpack(), tt = targets.unpack();
    const float upstream = g[0].item();
    const int64_t rows = tx.size(0), hidden = tw.size(1), vocab = tw.size(0);
    Tensor dx, dw;
    if (x_needs_grad) dx = empty_like(tx);
    // With no rows the loop below never writes d(w), which is then zero.
    if (w_needs_grad)
      dw = rows == 0 ? zeros(tw.shape(), DType::F32, tw.device())
                     : empty(tw.shape(), DType::F32, tw.device());
    Backend& backend = backend_of(tx);
    Tensor logits = empty({std::min(chunk_rows, rows), vocab}, tx.dtype(), tx.device());
    for (int64_t start = 0; start < rows; start += chunk_rows) {
      const int64_t n = std::min(chunk_rows, rows - start);
      Tensor dlogits = logits.slice_rows(0, n);
      chunk_logits(tx, tw, start, n, dlogits);
      backend.cross_entropy_backward(dlogits, tt.slice_rows(start, n), upstream, dlogits, true);
      if (x_needs_grad) {  // d(x) rows = d(logits) [n, V] @ w [V, H]
        GemmArgs args;
        args.m = n;
        args.n = hidden;
        args.k = vocab;
        args.offset_c = start * hidden;
        backend.gemm(args, dlogits, tw, dx);
      }
      if (w_needs_grad) {  // d(w) += d(logits)^T [V, n] @ x rows [n, H]
        GemmArgs args;
        args.trans_a = true;
        args.m = vocab;
        args.n = hidden;
        args.k = n;
        args.beta = start == 0 ? 0.0f : 1.0f;
        args.offset_b = start * hidden;
        backend.gemm(args, dlogits, tx, dw);
      }
    }
    if (w_needs_grad) dw = in_dtype(dw, tw.dtype());
    return {dx, dw, Tensor()};
  }
  void release_saved() override {
    x.release();
    w.release();
    targets.release();
  }
};

// Checks target ids against the vocabulary (on the host, so the error names the row) and
// counts those that are not -100.
int64_t checked_target_count(const Tensor& targets, int64_t vocab) {
  std::vector<int64_t> t = targets.to_int_vector();
  int64_t n = 0;
  for (size_t i = 0; i < t.size(); ++i) {
    ST_CHECK_SHAPE(t[i] == -100 || (t[i] >= 0 && t[i] < vocab), "cross_entropy: target ", t[i],
                   " at row ", i, " is outside the vocabulary [0, ", vocab, ") and is not -100");
    n += (t[i] != -100);
  }
  return n;
}

Tensor scalar_on(double value, Device device) {
  return from_floats({static_cast<float>(value)}, {1}, DType::F32, device);
}
}  // namespace

int64_t count_targets(const Tensor& targets) {
  int64_t n = 0;
  for (int64_t t : targets.to_int_vector()) n += (t != -100);
  return n;
}

Tensor cross_entropy_sum(const Tensor& logits, const Tensor& targets, int64_t* counted) {
  check_float(logits, "cross_entropy", "logits");
  ST_CHECK_SHAPE(logits.dim() == 2 && targets.dtype() == DType::I64 && targets.dim() == 1 &&
                     targets.size(0) == logits.size(0),
                 "cross_entropy: expected logits [N, V] and int64 targets [N], got ",
                 logits.describe(), " and ", targets.describe());
  const int64_t n = checked_target_count(targets, logits.size(1));
  if (counted) *counted = n;
  Tensor losses = empty({logits.size(0)}, DType::F32, logits.device());
  backend_of(logits).cross_entropy_forward(logits, targets, losses, true);
  Tensor out = scalar_on(backend_of(losses).sum(losses), logits.device());
  if (autograd::needs_graph({&logits})) {
    auto node = std::make_shared<CrossEntropyBackward>();
    node->logits = SavedTensor(logits);
    node->targets = SavedTensor(targets);
    autograd::attach(node, {&logits, &targets}, {&out});
  }
  return out;
}

Tensor linear_cross_entropy_sum(const Tensor& x, const Tensor& w, const Tensor& targets,
                                int64_t chunk_rows, int64_t* counted) {
  check_float(x, "linear_cross_entropy", "input");
  check_same(x, w, "linear_cross_entropy");
  ST_CHECK_SHAPE(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) &&
                     targets.dtype() == DType::I64 && targets.dim() == 1 &&
                     targets.size(0) == x.size(0),
                 "linear_cross_entropy: expected input [N, H], weight [V, H] and int64 targets "
                 "[N], got ",
                 x.describe(), ", ", w.describe(), " and ", targets.describe());
  ST_CHECK_SHAPE(chunk_rows > 0, "linear_cross_entropy: rows per chunk must be positive, got ",
                 chunk_rows);
  const int64_t rows = x.size(0), vocab = w.size(0);
  const int64_t n = checked_target_count(targets, vocab);
  if (counted) *counted = n;
  Backend& backend = backend_of(x);
  Tensor losses = empty({rows}, DType::F32, x.device());
  {
    // One chunk's logits at a time; the per-row losses are all that outlives a chunk.
    Tensor logits = empty({std::min(chunk_rows, rows), vocab}, x.dtype(), x.device());
    for (int64_t start = 0; start < rows; start += chunk_rows) {
      const int64_t len = std::min(chunk_rows, rows - start);
      Tensor chunk = logits.slice_rows(0, len);
      chunk_logits(x, w, start, len, chunk);
      Tensor chunk_losses = losses.slice_rows(start, len);
      backend.cross_entropy_forward(chunk, targets.slice_rows(start, len), chunk_losses, true);
    }
  }
  Tensor out = scalar_on(backend.sum(losses), x.device());
  if (autograd::needs_graph({&x, &w})) {
    auto node = std::make_shared<LinearCrossEntropyBackward>();
    node->x_needs_grad = autograd::requires_grad(x);
    node->w_needs_grad = autograd::requires_grad(w);
    node->chunk_rows = chunk_rows;
    node->x = SavedTensor(x);
    node->w = SavedTensor(w);
    node->targets = SavedTensor(targets);
    autograd::attach(node, {&x, &w, &targets}, {&out});
  }
  return out;
}

double sum(const Tensor& x) {
  return backend_of(x).sum(x);
}
double sum_squares(const Tensor& x) {
  return backend_of(x).sum_squares(x);
}

}  // namespace shardtrain::ops
