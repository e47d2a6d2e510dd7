// Layout changes: the [A, B, C, D] -> [A, C, B, D] permutation that splits and merges heads.
#include <cstring>

#include "cpu_backend.h"

namespace shardtrain {

void CpuBackend::permute_0213(const Tensor& x, Tensor& out) {
  const int64_t A = x.size(0), B = x.size(1), C = x.size(2), D = x.size(3);
  const char* src = static_cast<const char*>(x.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  const size_t sw = dtype_size(x.dtype()), dw = dtype_size(out.dtype());
  const bool same = x.dtype() == out.dtype();
  const int64_t rows = A * C * B;
#pragma omp parallel for schedule(static) if (rows * D > cpu::kChunk)
  for (int64_t r = 0; r < rows; ++r) {
    // r enumerates output rows (a, c, b).
    const int64_t b = r % B, c = (r / B) % C, a = r / (B * C);
    const int64_t in_row = (a * B + b) * C + c;
    const char* s = src + in_row * D * sw;
    char* d = dst + r * D * dw;
    if (same)
      std::memcpy(d, s, D * sw);
    else
      convert_elements(s, x.dtype(), d, out.dtype(), D);
  }
}

}  // namespace shardtrain
