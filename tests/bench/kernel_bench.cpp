// shardtrain-kernel-bench: times the CUDA backend's kernels on realistic shapes.
//
//   shardtrain-kernel-bench [--iters N] [--warmup N] [--device I] [--json PATH] [--only NAME]
//
// Each kernel runs `warmup` times, then `iters` times between CUDA events; the median is
// reported with the achieved bandwidth (bytes the kernel must move at least, over the time) or
// arithmetic rate (useful FLOPs: causal attention counts half the S x S products, and its
// backward 2.5 times the forward, as flash-attention papers do).
//
// Attention runs on several shapes (plain multi-head, grouped-query, and the shapes of
// configs/llama-1b.yaml and configs/llama-125m.yaml at sequence 2048); each attention result in
// the JSON carries its shape as numbers under "params", which tests/bench/sdpa_reference.py reads
// to time PyTorch's scaled_dot_product_attention on exactly the same shapes.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

// src/backend/cuda/: the kernel interface (which alone chooses one backward form) and the
// backend's scratch memory for it.
#include "backend/cuda/cuda_backend.h"
#include "shardtrain/autograd/engine.h"
#include "shardtrain/autograd/node.h"
#include "shardtrain/backend/backend.h"
#include "shardtrain/backend/cuda.h"
#include "shardtrain/core/error.h"
#include "shardtrain/ops/ops.h"

namespace {

using namespace shardtrain;

struct Options {
  int iters = 20;
  int warmup = 3;
  int device = 0;
  std::string json;
  std::string only;
};

struct Result {
  std::string name, shape;
  double median_ms = 0;
  double gbps = 0;        // 0 when the kernel is reported in TFLOP/s
  double tflops = 0;      // 0 when the kernel is reported in GB/s
  nlohmann::json params;  // the shape as numbers (attention only); null otherwise
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw ConfigError(a + " needs a value");
      return argv[++i];
    };
    if (a == "--iters")
      o.iters = std::max(1, std::stoi(value()));
    else if (a == "--warmup")
      o.warmup = std::max(0, std::stoi(value()));
    else if (a == "--device")
      o.device = std::stoi(value());
    else if (a == "--json")
      o.json = value();
    else if (a == "--only")
      o.only = value();
    else if (a == "--help" || a == "-h") {
      std::cout << "usage: shardtrain-kernel-bench [--iters N] [--warmup N] [--device I] "
                   "[--json PATH] [--only NAME]\n";
      std::exit(0);
    } else {
      throw ConfigError("unknown argument '" + a + "' (see --help)");
    }
  }
  return o;
}

class Bench {
 public:
  explicit Bench(const Options& o) : o_(o), dev_(Device::cuda(o.device)), be_(backend_for(dev_)) {}

  Device dev() const { return dev_; }
  Backend& backend() { return be_; }

  // Times `op`; `bytes` or `flops` (one of them non-zero) gives the rate.
  void run(const std::string& name, const std::string& shape, double bytes, double flops,
           const std::function<void()>& op, const nlohmann::json& params = nullptr) {
    if (!o_.only.empty() && name.find(o_.only) == std::string::npos) return;
    const cuda::StreamView stream = cuda::current_stream(o_.device);
    for (int i = 0; i < o_.warmup; ++i) op();
    std::vector<double> ms;
    cuda::Event start(true), stop(true);
    for (int i = 0; i < o_.iters; ++i) {
      start.record(stream);
      op();
      stop.record(stream);
      stop.synchronize();
      ms.push_back(start.elapsed_ms(stop));
    }
    std::sort(ms.begin(), ms.end());
    Result r{name, shape, ms[ms.size() / 2], 0, 0, params};
    const double seconds = r.median_ms * 1e-3;
    if (bytes > 0) r.gbps = bytes / seconds * 1e-9;
    if (flops > 0) r.tflops = flops / seconds * 1e-12;
    std::printf("%-28s %-34s %10.3f ms  %s\n", name.c_str(), shape.c_str(), r.median_ms,
                (r.tflops > 0 ? fmt_rate(r.tflops, "TFLOP/s") : fmt_rate(r.gbps, "GB/s")).c_str());
    std::fflush(stdout);
    results_.push_back(r);
  }

  const std::vector<Result>& results() const { return results_; }

 private:
  static std::string fmt_rate(double v, const char* unit) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%9.1f %s", v, unit);
    return buf;
  }

  Options o_;
  Device dev_;
  Backend& be_;
  std::vector<Result> results_;
};

Tensor randn_on(const Shape& shape, DType t, Device d, uint64_t seed, float stddev = 1.0f) {
  Generator gen(seed);
  return randn(shape, gen, stddev, t, d);
}

void bench_gemm(Bench& b) {
  const int64_t n = 4096;
  Tensor a = randn_on({n, n}, DType::BF16, b.dev(), 1),
         w = randn_on({n, n}, DType::BF16, b.dev(), 2);
  Tensor c16 = empty({n, n}, DType::BF16, b.dev()), c32 = empty({n, n}, DType::F32, b.dev());
  GemmArgs g;
  g.m = g.n = g.k = n;
  const double flops = 2.0 * n * n * n;
  b.run("gemm_bf16", "4096x4096x4096 -> bf16", 0, flops, [&] { b.backend().gemm(g, a, w, c16); });
  g.trans_b = true;
  b.run("gemm_bf16_nt_f32out", "4096x4096x4096 B^T -> f32", 0, flops,
        [&] { b.backend().gemm(g, a, w, c32); });
}

struct AttentionShape {
  int64_t batch, heads_q, heads_kv, seq, head_dim;
};

// Causal, bf16. tests/bench/sdpa_reference.py holds the same list (used when it is given no
// kernel-bench JSON to read the shapes from): keep the two equal.
constexpr AttentionShape kAttentionShapes[] = {
    {4, 16, 16, 2048, 128},  // plain multi-head attention
    {2, 32, 8, 2048, 128},   // grouped-query, Llama-3-8B's heads
    {1, 32, 8, 2048, 64},    // configs/llama-1b.yaml at micro-batch 1,
    {4, 32, 8, 2048, 64},    // its own micro-batch 4
    {8, 32, 8, 2048, 64},    // and 8
    {8, 12, 12, 2048, 64},   // configs/llama-125m.yaml at its micro-batch 8
};

void bench_attention(Bench& b, const AttentionShape& a) {
  const int64_t B = a.batch, Hq = a.heads_q, Hkv = a.heads_kv, S = a.seq, D = a.head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  Tensor q = randn_on({B, Hq, S, D}, DType::BF16, b.dev(), 3);
  Tensor k = randn_on({B, Hkv, S, D}, DType::BF16, b.dev(), 4);
  Tensor v = randn_on({B, Hkv, S, D}, DType::BF16, b.dev(), 5);
  Tensor out = empty({B, Hq, S, D}, DType::BF16, b.dev());
  Tensor lse = empty({B, Hq, S}, DType::F32, b.dev());
  Tensor dout = randn_on({B, Hq, S, D}, DType::BF16, b.dev(), 6);
  Tensor dq = empty(q.shape(), DType::BF16, b.dev()), dk = empty(k.shape(), DType::BF16, b.dev()),
         dv = empty(v.shape(), DType::BF16, b.dev());
  // Useful FLOPs: two S x S x D products per head, half of them masked.
  const double fwd_flops = 4.0 * static_cast<double>(B * Hq) * static_cast<double>(S * S * D) / 2.0;
  const std::string heads = Hq == Hkv ? "H=" + std::to_string(Hq)
                                      : "Hq=" + std::to_string(Hq) + " Hkv=" + std::to_string(Hkv);
  const std::string shape = "B=" + std::to_string(B) + " " + heads + " S=" + std::to_string(S) +
                            " D=" + std::to_string(D) + " causal";
  const nlohmann::json params = {{"batch", B},    {"heads_q", Hq},  {"heads_kv", Hkv}, {"seq", S},
                                 {"head_dim", D}, {"causal", true}, {"dtype", "bf16"}};
  b.run(
      "attention_fwd_bf16", shape, 0, fwd_flops,
      [&] { b.backend().attention_forward(q, k, v, scale, out, lse); }, params);
  // The two backward algorithms (backend/attention.h): the default deterministic one, and the
  // one pass that sums dQ with atomics.
  const std::pair<const char*, AttentionBackwardAlgo> backwards[] = {
      {"attention_bwd_bf16", AttentionBackwardAlgo::Deterministic},
      {"attention_bwd_atomic_dq_bf16", AttentionBackwardAlgo::AtomicDq}};
  for (const auto& backward : backwards) {
    const AttentionBackwardAlgo algo = backward.second;
    b.run(
        backward.first, shape, 0, 2.5 * fwd_flops,
        [&] { b.backend().attention_backward(q, k, v, out, lse, dout, scale, dq, dk, dv, algo); },
        params);
  }
  // At head dim 64 the dK/dV kernel's warps take two 16-key m-tiles by default; the form with
  // one (the only one at head dim 128) is timed too, under both backwards, through the kernel
  // interface, which is the only place that chooses it. Same results to the bit (the atomic dQ
  // aside), so only the time differs. With atomic dQ, two m-tiles spill a few registers.
  if (D == 64) {
    const kernels::AttentionDims dims{B, Hq, Hkv, S, D, scale};
    auto* stream = static_cast<cudaStream_t>(cuda::current_stream(b.dev().index).handle());
    const std::pair<const char*, AttentionBackwardAlgo> one_m_tile_backwards[] = {
        {"attention_bwd_one_key_mtile_bf16", AttentionBackwardAlgo::Deterministic},
        {"attention_bwd_atomic_dq_one_key_mtile_bf16", AttentionBackwardAlgo::AtomicDq}};
    for (const auto& backward : one_m_tile_backwards) {
      kernels::AttentionBackwardOptions options;
      options.algo = backward.second;
      options.dkdv_m_tiles = 1;
      b.run(
          backward.first, shape, 0, 2.5 * fwd_flops,
          [&] {
            // Temporaries from the caching allocator, as in a backend call.
            cuda::CallScratch scratch(b.dev().index);
            kernels::attention_backward(dims, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                        out.data_ptr(), static_cast<const float*>(lse.data_ptr()),
                                        dout.data_ptr(), DType::BF16, dq.data_ptr(), dk.data_ptr(),
                                        dv.data_ptr(), options, scratch, stream);
          },
          params);
    }
  }
}

void bench_rmsnorm(Bench& b) {
  const int64_t N = 16384, H = 4096;
  Tensor x = randn_on({N, H}, DType::BF16, b.dev(), 7), w = randn_on({H}, DType::BF16, b.dev(), 8);
  Tensor y = empty({N, H}, DType::BF16, b.dev()), rstd = empty({N}, DType::F32, b.dev());
  Tensor dy = randn_on({N, H}, DType::BF16, b.dev(), 9), dx = empty({N, H}, DType::BF16, b.dev());
  Tensor dw = zeros({H}, DType::F32, b.dev());
  const double elems = static_cast<double>(N) * H;
  b.run("rmsnorm_fwd_bf16", "16384x4096", 2 * elems * 2, 0,
        [&] { b.backend().rmsnorm_forward(x, w, 1e-5f, y, rstd); });
  b.run("rmsnorm_bwd_bf16", "16384x4096", 3 * elems * 2, 0,
        [&] { b.backend().rmsnorm_backward(dy, x, w, rstd, dx, dw); });
}

void bench_cross_entropy(Bench& b) {
  const int64_t N = 8192, V = 32000;
  Tensor logits = randn_on({N, V}, DType::BF16, b.dev(), 10, 3.0f);
  std::vector<int64_t> t(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) t[static_cast<size_t>(i)] = (i * 7919) % V;
  Tensor targets = from_ints(t, {N}, DType::I64, b.dev());
  Tensor losses = empty({N}, DType::F32, b.dev()), dlogits = empty({N, V}, DType::BF16, b.dev());
  const double bytes = static_cast<double>(N) * V * 2;
  b.run("cross_entropy_fwd_bf16", "8192x32000", bytes, 0,
        [&] { b.backend().cross_entropy_forward(logits, targets, losses); });
  b.run("cross_entropy_bwd_bf16", "8192x32000", 2 * bytes, 0,
        [&] { b.backend().cross_entropy_backward(logits, targets, 1.0f / N, dlogits); });
}

// The head and the loss of configs/llama-1b.yaml (hidden 2048, vocabulary 128256) over 4096
// tokens, forward and backward: whole logits (linear, then cross_entropy_sum) against the chunked
// fused op, which computes the head's product once more. The rate counts the 6 T V H FLOPs of
// the three products both need, so the chunked row's rate drops by the recompute it pays.
void bench_head_loss(Bench& b) {
  const int64_t T = 4096, H = 2048, V = 128256;
  Tensor x0 = randn_on({T, H}, DType::BF16, b.dev(), 11);
  Tensor w0 = randn_on({V, H}, DType::BF16, b.dev(), 12, 0.02f);
  std::vector<int64_t> t(static_cast<size_t>(T));
  for (int64_t i = 0; i < T; ++i) t[static_cast<size_t>(i)] = (i * 7919) % V;
  Tensor targets = from_ints(t, {T}, DType::I64, b.dev());
  const double flops = 6.0 * static_cast<double>(T) * static_cast<double>(V) * H;
  const std::string shape = "T=4096 H=2048 V=128256";
  for (int64_t chunk : {int64_t{0}, int64_t{256}, int64_t{1024}}) {
    auto step = [&] {
      Tensor x = x0.detach(), w = w0.detach();
      autograd::set_requires_grad(x);
      autograd::set_requires_grad(w);
      Tensor loss = chunk == 0 ? ops::cross_entropy_sum(ops::linear(x, w), targets)
                               : ops::linear_cross_entropy_sum(x, w, targets, chunk);
      autograd::backward(ops::scale(loss, 1.0f / static_cast<float>(T)));
    };
    b.run(chunk == 0 ? "head_loss_whole_bf16" : "head_loss_chunk" + std::to_string(chunk) + "_bf16",
          shape, 0, flops, step);
  }
}

void bench_adamw(Bench& b) {
  const int64_t n = 100'000'000;
  Tensor p = randn_on({n}, DType::F32, b.dev(), 11), g = randn_on({n}, DType::BF16, b.dev(), 12);
  Tensor m = zeros({n}, DType::F32, b.dev()), v = zeros({n}, DType::F32, b.dev());
  int64_t step = 0;
  // p, m, v read and written (f32) and a bf16 gradient read.
  b.run("adamw_f32_bf16grad", "100M params", n * (3.0 * 4 * 2 + 2), 0, [&] {
    b.backend().adamw(p, g, m, v, {1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, ++step});
  });
}

// One optimizer step over a whole model's tensors: llama-125m's 111 parameter tensors (the
// embedding and head, per layer 4 attention, 3 MLP and 2 norm weights, the final norm; 134M
// parameters, bf16 gradients), one launch per tensor against the multi-tensor list. Same bytes;
// the difference is launch overhead.
void bench_adamw_model(Bench& b) {
  const int64_t vocab = 32000, h = 768, f = 2048, layers = 12;
  std::vector<Shape> shapes = {{vocab, h}, {vocab, h}, {h}};
  for (int64_t l = 0; l < layers; ++l)
    for (const Shape& s :
         std::vector<Shape>{{h, h}, {h, h}, {h, h}, {h, h}, {f, h}, {f, h}, {h, f}, {h}, {h}})
      shapes.push_back(s);
  std::vector<Tensor> p, g, m, v;
  double bytes = 0;
  for (size_t i = 0; i < shapes.size(); ++i) {
    p.push_back(randn_on(shapes[i], DType::F32, b.dev(), 30 + i));
    g.push_back(randn_on(shapes[i], DType::BF16, b.dev(), 400 + i));
    m.push_back(zeros(shapes[i], DType::F32, b.dev()));
    v.push_back(zeros(shapes[i], DType::F32, b.dev()));
    bytes += static_cast<double>(numel(shapes[i])) * (3.0 * 4 * 2 + 2);
  }
  std::vector<Backend::AdamWTensor> list;
  for (size_t i = 0; i < shapes.size(); ++i) list.push_back({&p[i], &g[i], &m[i], &v[i], true});
  const std::string shape = std::to_string(shapes.size()) + " tensors, llama-125m";
  int64_t step = 0;
  b.run("adamw_per_tensor_model", shape, bytes, 0, [&] {
    const Backend::AdamWArgs args{1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, ++step};
    for (size_t i = 0; i < shapes.size(); ++i) b.backend().adamw(p[i], g[i], m[i], v[i], args);
  });
  b.run("adamw_multi_tensor_model", shape, bytes, 0, [&] {
    b.backend().adamw_multi(list, {1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, ++step});
  });
  std::vector<const Tensor*> grads;
  for (const Tensor& t : g) grads.push_back(&t);
  double grad_bytes = 0;
  for (const Tensor& t : g) grad_bytes += static_cast<double>(t.nbytes());
  b.run("grad_norm_per_tensor_model", shape, grad_bytes, 0, [&] {
    for (const Tensor& t : g) (void)b.backend().sum_squares(t);
  });
  b.run("grad_norm_multi_model", shape, grad_bytes, 0,
        [&] { (void)b.backend().sum_squares_multi(grads); });
  // The fp16 loss-scaling check, read and written in place; a factor of 1 keeps the values.
  std::vector<Tensor*> grads_rw;
  for (Tensor& t : g) grads_rw.push_back(&t);
  b.run("unscale_per_tensor_model", shape, 2 * grad_bytes, 0, [&] {
    for (Tensor& t : g) (void)b.backend().unscale_and_check(t, 1.0f);
  });
  b.run("unscale_multi_model", shape, 2 * grad_bytes, 0,
        [&] { (void)b.backend().unscale_and_check_multi(grads_rw, 1.0f); });
}

void bench_elementwise(Bench& b) {
  const int64_t n = int64_t{64} << 20;
  Tensor gte = randn_on({n}, DType::BF16, b.dev(), 13),
         up = randn_on({n}, DType::BF16, b.dev(), 14);
  Tensor out = empty({n}, DType::BF16, b.dev());
  b.run("swiglu_fwd_bf16", "64M", 3.0 * n * 2, 0,
        [&] { b.backend().swiglu_forward(gte, up, out); });
  b.run("add_bf16", "64M", 3.0 * n * 2, 0, [&] { b.backend().add(gte, up, out, 1.0f, 1.0f); });
  Tensor x = randn_on({4, 2048, 32, 128}, DType::BF16, b.dev(), 15);
  b.run("rope_bf16", "4x2048x32x128", 2.0 * x.numel() * 2, 0,
        [&] { b.backend().rope(x, x, RopeParams{10000.0f}, 0, false); });
  // [B, S, H, D] -> [B, H, S, D], as the attention's inputs are laid out for the fused kernels.
  Tensor permuted = empty({4, 32, 2048, 128}, DType::BF16, b.dev());
  b.run("permute_0213_bf16", "4x2048x32x128", 2.0 * x.numel() * 2, 0,
        [&] { b.backend().permute_0213(x, permuted); });
  const int64_t V = 32000, H = 4096, N = 8192;
  Tensor table = randn_on({V, H}, DType::BF16, b.dev(), 16);
  std::vector<int64_t> ids(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) ids[static_cast<size_t>(i)] = (i * 104729) % V;
  Tensor id_t = from_ints(ids, {N}, DType::I64, b.dev());
  Tensor emb = empty({N, H}, DType::BF16, b.dev()), gw = zeros({V, H}, DType::F32, b.dev());
  b.run("embedding_fwd_bf16", "8192 of 32000x4096", 2.0 * N * H * 2, 0,
        [&] { b.backend().embedding_forward(table, id_t, emb); });
  b.run("embedding_bwd_bf16", "8192 of 32000x4096", N * H * (2.0 + 8.0), 0,
        [&] { b.backend().embedding_backward(emb, id_t, gw); });
  Tensor big = randn_on({n}, DType::F32, b.dev(), 17);
  b.run("sum_squares_f32", "64M", 4.0 * n, 0, [&] { (void)b.backend().sum_squares(big); });
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse(argc, argv);
    if (!cuda_backend_available()) {
      std::fprintf(stderr, "shardtrain-kernel-bench: no CUDA GPU (cuda::device_count() = %d)\n",
                   cuda::device_count());
      return 2;
    }
    cuda::DeviceGuard guard(o.device);
    const std::string device = cuda::device_description(o.device);
    std::printf("device: %s\niterations: %d (median reported), warmup %d\n\n", device.c_str(),
                o.iters, o.warmup);
    Bench b(o);
    // Each section on its own: a kernel that fails (none of them had run on a GPU before this
    // bench) is reported and the others are still measured, and the JSON is written either way.
    std::vector<std::pair<std::string, std::function<void()>>> sections = {
        {"gemm", [&] { bench_gemm(b); }}};
    for (const AttentionShape& shape : kAttentionShapes)
      sections.emplace_back(
          "attention B" + std::to_string(shape.batch) + " Hq" + std::to_string(shape.heads_q) +
              " Hkv" + std::to_string(shape.heads_kv) + " D" + std::to_string(shape.head_dim),
          [&b, &shape] { bench_attention(b, shape); });
    sections.emplace_back("rmsnorm", [&] { bench_rmsnorm(b); });
    sections.emplace_back("cross_entropy", [&] { bench_cross_entropy(b); });
    sections.emplace_back("head_loss", [&] { bench_head_loss(b); });
    sections.emplace_back("adamw", [&] { bench_adamw(b); });
    sections.emplace_back("adamw_model", [&] { bench_adamw_model(b); });
    sections.emplace_back("elementwise", [&] { bench_elementwise(b); });
    std::vector<std::pair<std::string, std::string>> errors;
    for (auto& [name, run] : sections) {
      try {
        run();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "shardtrain-kernel-bench: section %s failed: %s\n", name.c_str(),
                     e.what());
        errors.emplace_back(name, e.what());
      }
    }
    if (!o.json.empty()) {
      nlohmann::json j;
      j["device"] = device;
      j["iters"] = o.iters;
      j["results"] = nlohmann::json::array();
      for (const Result& r : b.results()) {
        nlohmann::json entry = {{"name", r.name},
                                {"shape", r.shape},
                                {"median_ms", r.median_ms},
                                {"gbps", r.gbps},
                                {"tflops", r.tflops}};
        if (!r.params.is_null()) entry["params"] = r.params;
        j["results"].push_back(entry);
      }
      j["errors"] = nlohmann::json::array();
      for (const auto& [name, message] : errors)
        j["errors"].push_back({{"section", name}, {"message", message}});
      std::ofstream out(o.json);
      if (!out) throw ConfigError("cannot write --json file '" + o.json + "'");
      out << j.dump(2) << "\n";
      std::printf("\nwrote %s\n", o.json.c_str());
    }
    if (!errors.empty()) {
      std::fprintf(stderr, "shardtrain-kernel-bench: %zu of %zu sections failed\n", errors.size(),
                   sections.size());
      return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shardtrain-kernel-bench: %s\n", e.what());
    return 1;
  }
}
