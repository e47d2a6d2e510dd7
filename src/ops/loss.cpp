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
    backend_of(tl).cross_entropy_backward(tl, targets.unpack(), upstream, dl);
    return {dl, Tensor()};
  }
  void release_saved() override {
    logits.release();
    targets.release();
  }
};
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
  std::vector<int64_t> t = targets.to_int_vector();
  int64_t vocab = logits.size(1), n = 0;
  for (size_t i = 0; i < t.size(); ++i) {
    ST_CHECK_SHAPE(t[i] == -100 || (t[i] >= 0 && t[i] < vocab), "cross_entropy: target ", t[i],
                   " at row ", i, " is outside the vocabulary [0, ", vocab, ") and is not -100");
    n += (t[i] != -100);
  }
  if (counted) *counted = n;
  Tensor losses = empty({logits.size(0)}, DType::F32, logits.device());
  backend_of(logits).cross_entropy_forward(logits, targets, losses);
  Tensor out = from_floats({static_cast<float>(backend_of(losses).sum(losses))}, {1}, DType::F32,
                           logits.device());
  if (autograd::needs_graph({&logits})) {
    auto node = std::make_shared<CrossEntropyBackward>();
    node->logits = SavedTensor(logits);
    node->targets = SavedTensor(targets);
    autograd::attach(node, {&logits, &targets}, {&out});
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
