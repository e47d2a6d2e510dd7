#include "shardtrain/dist/process_group.h"

namespace shardtrain::dist {

namespace {
class CompletedWork : public Work {
 public:
  void wait() override {}
  bool is_completed() override { return true; }
};
}  // namespace

std::string_view reduce_op_name(ReduceOp op) {
  return op == ReduceOp::Sum ? "sum" : "max";
}

WorkPtr completed_work() {
  return std::make_shared<CompletedWork>();
}

double ProcessGroup::all_reduce_host(double value, ReduceOp op) {
  std::vector<double> v{value};
  all_reduce_host(v, op);
  return v[0];
}

int64_t ProcessGroup::all_reduce_host(int64_t value, ReduceOp op) {
  std::vector<int64_t> v{value};
  all_reduce_host(v, op);
  return v[0];
}

std::vector<bool> ProcessGroup::differs_between_ranks(const std::vector<uint64_t>& values) {
  // One all-reduce (max) of every value and of its bitwise complement gives the largest and the
  // smallest value over the ranks (~v = -v - 1 reverses the order of int64 and, unlike -v, never
  // overflows); they differ where some rank disagrees.
  const size_t n = values.size();
  std::vector<int64_t> extremes(2 * n);
  for (size_t i = 0; i < n; ++i) {
    extremes[i] = static_cast<int64_t>(values[i]);
    extremes[n + i] = ~extremes[i];
  }
  if (size() > 1) all_reduce_host(extremes, ReduceOp::Max);
  std::vector<bool> differs(n);
  for (size_t i = 0; i < n; ++i) differs[i] = extremes[i] != ~extremes[n + i];
  return differs;
}

void ProcessGroup::check_all_gather(const Tensor& input, const Tensor& output) const {
  ST_CHECK_SHAPE(input.defined() && output.defined(), "all_gather: undefined tensor");
  ST_CHECK_SHAPE(input.dtype() == output.dtype(), "all_gather: input ", input.describe(),
                 " and output ", output.describe(), " have different dtypes");
  ST_CHECK_SHAPE(output.numel() == input.numel() * size(), "all_gather over ", size(),
                 " ranks: output ", output.describe(), " must hold ", size(), " x ", input.numel(),
                 " elements");
}

void ProcessGroup::check_reduce_scatter(const Tensor& input, const Tensor& output) const {
  ST_CHECK_SHAPE(input.defined() && output.defined(), "reduce_scatter: undefined tensor");
  ST_CHECK_SHAPE(input.dtype() == output.dtype(), "reduce_scatter: input ", input.describe(),
                 " and output ", output.describe(), " have different dtypes");
  ST_CHECK_SHAPE(input.numel() == output.numel() * size(), "reduce_scatter over ", size(),
                 " ranks: input ", input.describe(), " must hold ", size(), " x ", output.numel(),
                 " elements");
  check_reduce(input, "reduce_scatter");
}

void ProcessGroup::check_reduce(const Tensor& tensor, const char* what) const {
  ST_CHECK_SHAPE(tensor.defined(), what, ": undefined tensor");
  DType t = tensor.dtype();
  ST_CHECK_SHAPE(
      t == DType::F32 || t == DType::BF16 || t == DType::F16 || t == DType::I32 || t == DType::I64,
      what, ": cannot reduce ", tensor.describe(), " (floating or 32/64-bit integer tensors only)");
}

// ---- LocalProcessGroup ------------------------------------------------------------------------

WorkPtr LocalProcessGroup::all_gather(const Tensor& input, Tensor& output) {
  check_all_gather(input, output);
  if (input.data_ptr() != output.data_ptr()) output.copy_from(input);
  return completed_work();
}

WorkPtr LocalProcessGroup::reduce_scatter(const Tensor& input, Tensor& output) {
  check_reduce_scatter(input, output);
  if (input.data_ptr() != output.data_ptr()) output.copy_from(input);
  return completed_work();
}

WorkPtr LocalProcessGroup::all_reduce(Tensor& tensor, ReduceOp) {
  check_reduce(tensor, "all_reduce");
  return completed_work();
}

WorkPtr LocalProcessGroup::broadcast(Tensor& tensor, int root) {
  ST_CHECK_SHAPE(tensor.defined(), "broadcast: undefined tensor");
  ST_CHECK(root == 0, "broadcast from rank ", root, " in a group of one rank");
  return completed_work();
}

}  // namespace shardtrain::dist
