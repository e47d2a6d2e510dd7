// Workspace buffers and index validation shared by the CPU kernels.
#include "cpu_backend.h"

namespace shardtrain::cpu {

Tensor workspace(int64_t n) {
  CategoryScope scope(MemoryCategory::Workspace);
  return empty({n}, DType::F32, Device::cpu());
}

Fp32Span::Fp32Span(const Tensor& t, int64_t offset, int64_t n) {
  if (t.dtype() == DType::F32) {
    data_ = static_cast<const float*>(t.data_ptr()) + offset;
    return;
  }
  holder_ = workspace(n);
  float* dst = static_cast<float*>(holder_.data_ptr());
  parallel_chunks(n, [&](int64_t b, int64_t e) { load_floats(t, offset + b, e - b, dst + b); });
  data_ = dst;
}

void check_indices(const Tensor& ids, int64_t limit, int64_t ignore, const char* what) {
  ST_CHECK_SHAPE(ids.dtype() == DType::I64, what, " must be int64, got ", ids.describe());
  const int64_t* p = ids.data<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i) {
    ST_CHECK_SHAPE((p[i] >= 0 && p[i] < limit) || p[i] == ignore, what, " ", p[i], " at position ",
                   i, " is outside [0, ", limit, ")",
                   p[i] < 0 ? ": ids are never negative (the input was built wrongly)"
                            : ": the data was tokenized with a vocabulary larger than the model's "
                              "vocab_size");
  }
}

}  // namespace shardtrain::cpu
