// [A, B, C, D] -> [A, C, B, D]: each output row (a, c, b) is input row (a, b, c), copied in the
// widest words that the row length and both pointers allow.
#include "common.cuh"

namespace shardtrain::kernels {

namespace {

// Index: the type of the loop's arithmetic, 32-bit when the tensor allows (index32_fits).
template <typename W, typename Index>
__global__ void permute_0213_kernel(const W* x, W* out, Index B, Index C, Index row_words,
                                    Index total) {
  for (Index idx = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<Index>(gridDim.x) * blockDim.x) {
    const Index r = idx / row_words, w = idx - r * row_words;
    const Index b = r % B, c = (r / B) % C, a = r / (B * C);
    out[idx] = x[((a * B + b) * C + c) * row_words + w];
  }
}

template <typename W>
void launch(const void* x, void* out, int64_t rows, int64_t B, int64_t C, int64_t row_bytes,
            cudaStream_t stream) {
  const int64_t row_words = row_bytes / static_cast<int64_t>(sizeof(W));
  const int64_t total = rows * row_words;
  const auto* px = static_cast<const W*>(x);
  auto* pout = static_cast<W*>(out);
  if (index32_fits(total))
    permute_0213_kernel<W, uint32_t><<<grid_for(total), kThreads, 0, stream>>>(
        px, pout, static_cast<uint32_t>(B), static_cast<uint32_t>(C),
        static_cast<uint32_t>(row_words), static_cast<uint32_t>(total));
  else
    permute_0213_kernel<W, int64_t>
        <<<grid_for(total), kThreads, 0, stream>>>(px, pout, B, C, row_words, total);
  ST_CHECK_LAUNCH();
}

}  // namespace

void permute_0213(const void* x, void* out, size_t element_size, int64_t A, int64_t B, int64_t C,
                  int64_t D, cudaStream_t stream) {
  const int64_t rows = A * B * C;
  const int64_t row_bytes = D * static_cast<int64_t>(element_size);
  if (rows == 0 || row_bytes == 0) return;
  auto fits = [&](int64_t w) {
    return row_bytes % w == 0 && aligned(x, static_cast<size_t>(w)) &&
           aligned(out, static_cast<size_t>(w));
  };
  if (fits(16))
    launch<uint4>(x, out, rows, B, C, row_bytes, stream);
  else if (fits(8))
    launch<uint2>(x, out, rows, B, C, row_bytes, stream);
  else if (fits(4))
    launch<uint32_t>(x, out, rows, B, C, row_bytes, stream);
  else if (fits(2))
    launch<uint16_t>(x, out, rows, B, C, row_bytes, stream);
  else
    launch<uint8_t>(x, out, rows, B, C, row_bytes, stream);
}

}  // namespace shardtrain::kernels
