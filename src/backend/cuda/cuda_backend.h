// The CUDA compute backend: cuBLASLt for matrix products, kernels/*.cu for everything else.
//
// One instance serves every GPU: each call runs on the device of its tensors, on this thread's
// current stream for that device (cuda::current_stream), and returns without waiting unless the
// interface says it returns a value to the host. Operands whose dtypes a kernel does not take
// directly (say a bf16 output of an f32 computation) are converted through workspace tensors.
#pragma once
#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "kernels.h"
#include "shardtrain/backend/backend.h"
#include "shardtrain/backend/cuda.h"

namespace shardtrain::cuda {

// Device memory for the temporaries of one backend call, from the caching allocator and counted
// as MemoryCategory::Workspace. Freed when the call returns; the caching allocator reuses it
// only for later work on the same stream, which runs after the kernels that used it.
class CallScratch final : public kernels::Scratch {
 public:
  explicit CallScratch(int device) : device_(device) {}
  void* get(size_t bytes) override;

 private:
  int device_;
  std::vector<DataPtr> buffers_;
};

// Matrix products through cuBLASLt, with plans (descriptors and the heuristic's algorithm)
// cached per shape.
class CublasLtGemm {
 public:
  CublasLtGemm();
  ~CublasLtGemm();
  CublasLtGemm(const CublasLtGemm&) = delete;
  CublasLtGemm& operator=(const CublasLtGemm&) = delete;

  // C = alpha op(A) op(B) + beta C with every pointer, dtype and layout already resolved:
  // A and B of `in_type`, C of `out_type` (equal to in_type, or F32 with 16-bit inputs).
  struct Problem {
    bool trans_a, trans_b;
    int64_t m, n, k, batch;
    int64_t stride_a, stride_b, stride_c;
    float alpha, beta;
    DType in_type, out_type;
    const void* a;
    const void* b;
    void* c;
  };
  void run(int device, cudaStream_t stream, const Problem& p);
  // Frees the workspace of a stream being destroyed (its work has finished).
  void forget_stream(int device, cudaStream_t stream);

 private:
  struct Plan;
  void* handle(int device);
  void* classic_handle(int device);  // cuBLAS, for what cuBLASLt has no algorithm for
  void run_classic(int device, cudaStream_t stream, const Problem& p, void* ws, size_t ws_bytes);
  // The stream's persistent workspace (kWorkspaceBytes, or none when it cannot be allocated).
  std::pair<void*, size_t> workspace(int device, cudaStream_t stream);

  std::mutex mutex_;
  std::map<int, void*> handles_;
  std::map<int, void*> classic_handles_;
  std::map<std::pair<int, cudaStream_t>, DataPtr> workspaces_;
  std::map<std::vector<int64_t>, std::unique_ptr<Plan>> plans_;
};

class CudaBackend final : public Backend {
 public:
  Device device() const override;
  void synchronize() override;

  void gemm(const GemmArgs& args, const Tensor& a, const Tensor& b, Tensor& c) override;
  // Drops what is kept per stream (the cuBLASLt workspace) for a stream being destroyed.
  void forget_stream(int device, cudaStream_t stream) { gemm_.forget_stream(device, stream); }

  void fill(Tensor& out, float value) override;
  void cast(const Tensor& src, Tensor& dst) override;
  void add(const Tensor& a, const Tensor& b, Tensor& out, float alpha, float beta) override;
  void mul(const Tensor& a, const Tensor& b, Tensor& out) override;
  void scale(const Tensor& a, Tensor& out, float alpha) override;
  void mul_lastdim(const Tensor& x, const Tensor& w, Tensor& out) override;
  void mul_lastdim_backward_weight(const Tensor& dy, const Tensor& x, Tensor& grad_w) override;

  void permute_0213(const Tensor& x, Tensor& out) override;

  void embedding_forward(const Tensor& weight, const Tensor& ids, Tensor& out) override;
  void embedding_backward(const Tensor& grad_out, const Tensor& ids, Tensor& grad_weight) override;

  void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, Tensor& y,
                       Tensor& rstd) override;
  void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                        Tensor& dx, Tensor& dw) override;

  void rope(const Tensor& x, Tensor& out, const RopeParams& params, int64_t position_offset,
            bool inverse) override;

  void causal_softmax(const Tensor& scores, float scale, Tensor& probs) override;
  void causal_softmax_backward(const Tensor& probs, const Tensor& dprobs, float scale,
                               Tensor& dscores) override;

  void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, float scale,
                         Tensor& out, Tensor& lse) override;
  void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                          const Tensor& lse, const Tensor& dout, float scale, Tensor& dq,
                          Tensor& dk, Tensor& dv, AttentionBackwardAlgo algo) override;

  void swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& out) override;
  void swiglu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate,
                       Tensor& dup) override;

  void cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& losses,
                             bool targets_checked = false) override;
  void cross_entropy_backward(const Tensor& logits, const Tensor& targets, float grad_scale,
                              Tensor& dlogits, bool targets_checked = false) override;

  // Defined in nf4.cpp.
  void nf4_dequantize(const Tensor& codes, const Tensor& absmax_q, const Tensor& absmax_scale,
                      float offset, Tensor& out) override;

  double sum(const Tensor& x) override;
  double sum_squares(const Tensor& x) override;

  bool unscale_and_check(Tensor& x, float inv_scale) override;
  void adamw(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v,
             const AdamWArgs& args) override;
  bool unscale_and_check_multi(const std::vector<Tensor*>& tensors, float inv_scale) override;
  std::vector<double> sum_squares_multi(const std::vector<const Tensor*>& tensors) override;
  void adamw_multi(const std::vector<AdamWTensor>& tensors, const AdamWArgs& args) override;

 private:
  CublasLtGemm gemm_;
};

// Registered with register_cuda_copy: synchronous between host and device, stream-ordered (on
// the current stream) between two buffers of the same device.
void copy_between_devices(void* dst, Device dst_device, const void* src, Device src_device,
                          size_t bytes);
// Registered with register_cuda_zero: a memset queued on the current stream of `device`.
void zero_on_device(void* dst, Device device, size_t bytes);
// Registered with register_device_cast: dtype conversion on the device, stream-ordered.
void cast_on_device(const Tensor& src, Tensor& dst);

}  // namespace shardtrain::cuda
