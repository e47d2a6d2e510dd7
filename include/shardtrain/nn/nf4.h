// 4-bit NormalFloat (NF4) storage of frozen weights, as in QLoRA and bitsandbytes'
// quantize_4bit(quant_type="nf4", blocksize=64, compress_statistics=True).
//
// Weights are split into blocks of 64 (row-major order); each block stores its absolute maximum
// and, per weight, the index of the nearest of 16 NormalFloat values (backend/nf4_codebook.h) to
// weight / absmax, two indices per byte (first weight in the high nibble). The block absmax values
// are quantized again ("double quantization"): their mean is subtracted, and the remainders are
// stored as 8-bit indices into bitsandbytes' dynamic map with one fp32 scale per 256 blocks.
// Storage per weight: 4 + 8/64 + 32/(64*256) = 4.127 bits (0.516 bytes).
//
// Measured reconstruction error on N(0, 1) weights (docs/qlora.md): RMS error 0.0919 of the
// weights' RMS with exact block scales, 0.0919 with double-quantized ones (+0.03%).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "shardtrain/nn/layers.h"

namespace shardtrain::nn {

struct Nf4Tensor {
  Tensor codes;             // U8 [ceil(n / 2)], two 4-bit codes per byte
  Tensor absmax_q;          // U8 [ceil(n / 64)], double-quantized block absmax
  Tensor absmax_scale;      // F32 [ceil(n / 64 / 256)], scale per group of 256 blocks
  float absmax_offset = 0;  // mean of the block absmax values
  Shape shape;              // of the original tensor

  // Quantizes a float tensor of any dtype and device (the arithmetic runs on the host). The result
  // lives on w's device, counted as MemoryCategory::Parameters. Throws ShapeError for an empty or
  // non-float tensor and for non-finite values.
  static Nf4Tensor quantize(const Tensor& w);

  // The weights rebuilt in `dtype` on the tensor's device through Backend::nf4_dequantize,
  // allocated under the current CategoryScope.
  Tensor dequantize(DType dtype = DType::F32) const;

  // The block absmax values as dequantization sees them (after double quantization), on the host.
  std::vector<float> block_absmax() const;

  int64_t numel() const { return shardtrain::numel(shape); }
  Device device() const { return codes.device(); }
  // Bytes of the three tensors (the offset and shape are host metadata).
  int64_t nbytes() const;
  // Throws FormatError starting with `what` (e.g. a file and tensor name) when the pieces do not
  // fit the shape (sizes, dtypes, devices).
  void validate(const std::string& what) const;
};

// x [..., in] @ W^T with W = dequantize(w) [out, in], W built in x's dtype as a temporary
// (MemoryCategory::Workspace) and freed before returning. The backward gives only dx: it
// rebuilds W from the codes instead of keeping it, so no activation memory holds a dense weight.
Tensor nf4_linear(const Tensor& x, const std::shared_ptr<const Nf4Tensor>& w);

// A frozen projection whose weight exists only in NF4. It registers no parameters (nothing to
// train or cast); the codes are counted as Parameters memory.
class Nf4Linear : public Linear {
 public:
  explicit Nf4Linear(Nf4Tensor weight);
  // Quantizes linear.weight (the caller frees the dense weight by dropping `linear`).
  static std::unique_ptr<Nf4Linear> from_linear(const Linear& linear);

  Tensor forward(const Tensor& x) override;

  const Nf4Tensor& quantized_weight() const { return *weight_; }
  const std::shared_ptr<const Nf4Tensor>& shared_weight() const { return weight_; }
  // Replaces the stored weight (e.g. loaded from a file); throws ShapeError when the shape differs.
  void set_quantized_weight(Nf4Tensor weight);
  Tensor dequantized_weight(DType dtype = DType::F32) const { return weight_->dequantize(dtype); }

 private:
  std::shared_ptr<const Nf4Tensor> weight_;
};

}  // namespace shardtrain::nn
