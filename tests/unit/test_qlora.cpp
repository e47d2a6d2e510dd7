// QLoRA: NF4 storage (code values, error, double quantization, bytes per weight, file round
// trip), the NF4 linear op (values, gradient, no dense weight kept), LoRA adapters (exact base
// equivalence at init, gradients, freezing), PEFT files (names, config keys, load errors), merged
// export and a short training run.
#include <gtest/gtest.h>

#include <unistd.h>
#include "expect_error.h"
#include "files.h"
#include "temp_dir.h"
#include "tiny_run.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <nlohmann/json.hpp>
#include <set>

#include "gradcheck.h"
#include "shardtrain/activation/strategy.h"
#include "shardtrain/autograd/engine.h"
#include "shardtrain/autograd/grad_mode.h"
#include "shardtrain/backend/backend.h"
#include "shardtrain/backend/nf4_codebook.h"
#include "shardtrain/io/bnb.h"
#include "shardtrain/io/hf_model.h"
#include "shardtrain/io/peft.h"
#include "shardtrain/nn/lora.h"
#include "shardtrain/nn/nf4.h"
#include "shardtrain/optim/optimizer.h"
#include "shardtrain/train/config.h"
#include "shardtrain/train/runtime.h"

namespace shardtrain {
namespace {

namespace fs = std::filesystem;
using testing::gradcheck;

// Measured on 2^20 N(0, 1) weights (seed 11); see docs/qlora.md.
constexpr double kNf4RelativeRmsError = 0.09192;    // exact block absmax
constexpr double kNf4RelativeRmsErrorDq = 0.09194;  // double-quantized block absmax

using shardtrain::testing::TempDir;

using shardtrain::testing::expect_error;

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::vector<float> exact_block_absmax(const std::vector<float>& w) {
  std::vector<float> out((w.size() + 63) / 64, 0.0f);
  for (size_t i = 0; i < w.size(); ++i) out[i / 64] = std::max(out[i / 64], std::fabs(w[i]));
  return out;
}

// Index of the NF4 value nearest to x by distance.
int nearest_code(float x) {
  int best = 0;
  for (int k = 1; k < 16; ++k)
    if (std::fabs(x - nf4::kNf4Code[static_cast<size_t>(k)]) <
        std::fabs(x - nf4::kNf4Code[static_cast<size_t>(best)]))
      best = k;
  return best;
}

// ---- code books -------------------------------------------------------------------------------

TEST(Nf4, CodeBooksMatchBitsandbytes) {
  EXPECT_EQ(nf4::kNf4Code[0], -1.0f);
  EXPECT_EQ(nf4::kNf4Code[7], 0.0f);
  EXPECT_EQ(nf4::kNf4Code[15], 1.0f);
  EXPECT_TRUE(std::is_sorted(nf4::kNf4Code.begin(), nf4::kNf4Code.end()));
  const auto& map = nf4::dynamic_map_8bit();
  EXPECT_TRUE(std::is_sorted(map.begin(), map.end()));
  EXPECT_EQ(map[255], 1.0f);
  EXPECT_FLOAT_EQ(map[0], -0.99296875f);  // -(0.9859375 + 1) / 2
  EXPECT_EQ(std::count(map.begin(), map.end(), 0.0f), 1);
  // The smallest magnitudes: 1e-6 * (0.1 + 1) / 2.
  auto zero = std::find(map.begin(), map.end(), 0.0f) - map.begin();
  EXPECT_FLOAT_EQ(map[static_cast<size_t>(zero) + 1], 5.5e-7f);
  EXPECT_FLOAT_EQ(map[static_cast<size_t>(zero) - 1], -5.5e-7f);
}

// ---- quantization -----------------------------------------------------------------------------

TEST(Nf4, DequantizedValuesAreScaledCodes) {
  Generator gen(5);
  Tensor w = randn({128, 640}, gen);  // 1280 blocks, 5 absmax groups
  nn::Nf4Tensor q = nn::Nf4Tensor::quantize(w);
  const std::vector<float> wv = w.to_float_vector(), dq = q.dequantize().to_float_vector();
  const std::vector<float> absmax = q.block_absmax(), exact = exact_block_absmax(wv);
  const std::vector<int64_t> codes = q.codes.to_int_vector();
  std::set<int> used;
  for (size_t i = 0; i < wv.size(); ++i) {
    const int code = static_cast<int>(i % 2 == 0 ? codes[i / 2] >> 4 : codes[i / 2] & 15);
    used.insert(code);
    // The stored code is the nearest NF4 value to the weight over its exact block absmax ...
    ASSERT_EQ(code, nearest_code(wv[i] / exact[i / 64])) << "element " << i;
    // ... and dequantizes to exactly that value times the double-quantized absmax.
    const float expected = nf4::kNf4Code[static_cast<size_t>(code)] * absmax[i / 64];
    ASSERT_EQ(std::memcmp(&dq[i], &expected, sizeof(float)), 0) << "element " << i;
  }
  EXPECT_EQ(used.size(), 16u);
}

// A block whose absmax is subnormal has no finite reciprocal: its zeros must stay zeros (0 x inf
// was NaN, which coded as -1, dequantizing to -absmax).
TEST(Nf4, ASubnormalBlockKeepsItsZeros) {
  std::vector<float> v(64, 0.0f);
  v[0] = 1e-40f;
  v[1] = -5e-41f;
  const nn::Nf4Tensor q = nn::Nf4Tensor::quantize(from_floats(v, {64}));
  const std::vector<float> dq = q.dequantize().to_float_vector();
  for (size_t i = 2; i < dq.size(); ++i) ASSERT_EQ(dq[i], 0.0f) << "element " << i;
}

TEST(Nf4, RmsErrorMatchesNf4) {
  Generator gen(11);
  Tensor w = randn({1024, 1024}, gen);
  nn::Nf4Tensor q = nn::Nf4Tensor::quantize(w);
  const std::vector<float> wv = w.to_float_vector(), dq = q.dequantize().to_float_vector();
  const std::vector<float> exact = exact_block_absmax(wv);
  const std::vector<int64_t> codes = q.codes.to_int_vector();
  double sq = 0, err = 0, err_exact = 0;
  for (size_t i = 0; i < wv.size(); ++i) {
    const int code = static_cast<int>(i % 2 == 0 ? codes[i / 2] >> 4 : codes[i / 2] & 15);
    const double e = static_cast<double>(nf4::kNf4Code[static_cast<size_t>(code)]) * exact[i / 64];
    sq += static_cast<double>(wv[i]) * wv[i];
    err += (static_cast<double>(dq[i]) - wv[i]) * (static_cast<double>(dq[i]) - wv[i]);
    err_exact += (e - wv[i]) * (e - wv[i]);
  }
  const double rel = std::sqrt(err / sq), rel_exact = std::sqrt(err_exact / sq);
  std::printf("NF4 relative RMS error: %.5f (exact absmax %.5f)\n", rel, rel_exact);
  EXPECT_NEAR(rel_exact, kNf4RelativeRmsError, 0.0005);
  EXPECT_NEAR(rel, kNf4RelativeRmsErrorDq, 0.0005);
  // Double quantization costs almost nothing on top of the 4-bit codes.
  EXPECT_LT(rel - rel_exact, 0.001);
}

TEST(Nf4, DoubleQuantizedAbsmaxWithin8BitError) {
  Generator gen(13);
  Tensor w = randn({300, 1000}, gen, 0.02f);  // 4688 blocks: 18 full groups and a partial one
  nn::Nf4Tensor q = nn::Nf4Tensor::quantize(w);
  const std::vector<float> exact = exact_block_absmax(w.to_float_vector());
  const std::vector<float> absmax = q.block_absmax();
  const std::vector<float> scales = q.absmax_scale.to_float_vector();
  ASSERT_EQ(absmax.size(), exact.size());
  ASSERT_EQ(scales.size(), (exact.size() + 255) / 256);
  double mean = 0;
  for (float m : exact) mean += m;
  mean /= static_cast<double>(exact.size());
  EXPECT_NEAR(q.absmax_offset, mean, 1e-6 * mean);
  // The coarsest step of the dynamic map is 0.9/64 in its top decade: half of it bounds the
  // error relative to each group's scale.
  const auto& map = nf4::dynamic_map_8bit();
  float max_gap = 0;
  for (size_t i = 1; i < map.size(); ++i) max_gap = std::max(max_gap, map[i] - map[i - 1]);
  EXPECT_NEAR(max_gap, 0.9f / 64, 1e-6f);
  double worst = 0;
  for (size_t b = 0; b < exact.size(); ++b) {
    const double bound = 0.5 * max_gap * scales[b / 256] + 1e-6 * exact[b];
    const double error = std::fabs(static_cast<double>(absmax[b]) - exact[b]);
    ASSERT_LE(error, bound) << "block " << b;
    worst = std::max(worst, error / exact[b]);
  }
  std::printf("double-quantized absmax: worst relative error %.5f\n", worst);
  EXPECT_LT(worst, 0.01);  // under 1% of any block's absmax
}

TEST(Nf4, BytesPerWeightFromParametersLedger) {
  Generator gen(17);
  Tensor w = randn({1024, 4096}, gen);
  Allocator& cpu = allocator_for(Device::cpu());
  const int64_t before = cpu.stats().in_use_of(MemoryCategory::Parameters);
  nn::Nf4Tensor q = nn::Nf4Tensor::quantize(w);
  const int64_t bytes = cpu.stats().in_use_of(MemoryCategory::Parameters) - before;
  const double per_weight = static_cast<double>(bytes) / static_cast<double>(w.numel());
  EXPECT_NEAR(per_weight, 4.127 / 8, 0.01 * 4.127 / 8);
  EXPECT_EQ(q.nbytes(), w.numel() / 2 + w.numel() / 64 + 4 * w.numel() / 64 / 256);
}

TEST(Nf4, OddSizesAndSafetensorsRoundTrip) {
  TempDir dir;
  Generator gen(19);
  Tensor w = randn({27, 37}, gen);  // 999 weights: a partial block and a half-used last byte
  nn::Nf4Tensor q = nn::Nf4Tensor::quantize(w);
  EXPECT_EQ(q.codes.numel(), 500);
  EXPECT_EQ(q.absmax_q.numel(), 16);
  EXPECT_EQ(q.absmax_scale.numel(), 1);
  const std::vector<float> dq = q.dequantize().to_float_vector();
  const std::vector<float> wv = w.to_float_vector(), exact = exact_block_absmax(wv);
  // Half the widest gap of the code book (between -1 and -0.6962) times the block's absmax,
  // plus the absmax's own 8-bit error.
  for (size_t i = 0; i < wv.size(); ++i)
    ASSERT_LE(std::fabs(dq[i] - wv[i]), 0.1520f * exact[i / 64] * 1.01f) << i;

  NamedTensors tensors;
  io::append_nf4(tensors, "layer.weight", q);
  save_safetensors(dir.str("q.safetensors"), tensors);
  SafetensorsFile file = SafetensorsFile::open(dir.str("q.safetensors"));
  EXPECT_EQ(file.names(),
            (std::vector<std::string>{"layer.weight.nf4.absmax", "layer.weight.nf4.absmax_offset",
                                      "layer.weight.nf4.absmax_scale", "layer.weight.nf4.codes",
                                      "layer.weight.nf4.shape"}));
  nn::Nf4Tensor back = io::read_nf4(file, "layer.weight");
  EXPECT_EQ(back.shape, q.shape);
  EXPECT_EQ(back.absmax_offset, q.absmax_offset);
  EXPECT_TRUE(bitwise_equal(back.dequantize().to_float_vector(), dq));
  // bf16 output rounds the same values.
  const std::vector<float> bf = q.dequantize(DType::BF16).to_float_vector();
  for (size_t i = 0; i < dq.size(); ++i) ASSERT_EQ(bf[i], round_to(DType::BF16, dq[i]));

  tensors.erase(tensors.begin() + 1);  // drop the absmax
  save_safetensors(dir.str("broken.safetensors"), tensors);
  SafetensorsFile broken = SafetensorsFile::open(dir.str("broken.safetensors"));
  expect_error<FormatError>([&] { io::read_nf4(broken, "layer.weight"); },
                            {"broken.safetensors", "layer.weight.nf4.absmax'"});
}

// ---- Nf4Linear ----------------------------------------------------------------------------------

TEST(Nf4Linear, ForwardAndBackwardEqualLinearWithDequantizedWeight) {
  Generator gen(23);
  nn::Linear dense(64, 48, Device::cpu());
  dense.weight.copy_from(randn({48, 64}, gen, 0.1f));
  auto q = nn::Nf4Linear::from_linear(dense);
  EXPECT_TRUE(q->named_parameters().empty());
  for (DType dtype : {DType::F32, DType::BF16}) {
    Tensor x = randn({2, 3, 64}, gen, 1.0f, dtype);
    autograd::set_requires_grad(x);
    Tensor x_ref = x.detach().clone();
    autograd::set_requires_grad(x_ref);
    Tensor w_ref = q->dequantized_weight(dtype);
    Tensor y = q->forward(x), y_ref = ops::linear(x_ref, w_ref);
    EXPECT_EQ(y.dtype(), dtype);
    EXPECT_TRUE(bitwise_equal(y.to_float_vector(), y_ref.to_float_vector()));
    Tensor dy = randn(y.shape(), gen, 1.0f, dtype);
    autograd::backward(y, dy);
    autograd::backward(y_ref, dy);
    EXPECT_TRUE(bitwise_equal(autograd::grad(x).to_float_vector(),
                              autograd::grad(x_ref).to_float_vector()));
    EXPECT_FALSE(autograd::grad(w_ref).defined());
  }
  Tensor x = testing::param({5, 64}, gen);
  gradcheck([&](const std::vector<Tensor>& t) { return q->forward(t[0]); }, {x});
}

TEST(Nf4Linear, KeepsNoDenseWeightForBackward) {
  Generator gen(29);
  nn::Linear dense(1024, 1024, Device::cpu());
  dense.weight.copy_from(randn({1024, 1024}, gen, 0.02f));
  auto q = nn::Nf4Linear::from_linear(dense);
  Tensor x = testing::param({2, 1024}, gen);
  Allocator& cpu = allocator_for(Device::cpu());
  const MemoryStats before = cpu.stats();
  cpu.reset_peak();
  Tensor y = q->forward(x);
  const MemoryStats after = cpu.stats();
  // The f32 dense weight (4 MiB) existed only as workspace during the product ...
  EXPECT_GE(after.peak_of(MemoryCategory::Workspace), 1024 * 1024 * 4);
  EXPECT_EQ(after.in_use_of(MemoryCategory::Workspace),
            before.in_use_of(MemoryCategory::Workspace));
  // ... and the graph holds only the output.
  EXPECT_LT(after.total_in_use - before.total_in_use, 64 * 1024);
  autograd::backward(ops::scale(y, 1.0f), ones(y.shape()));
  EXPECT_TRUE(autograd::grad(x).defined());
}

// ---- LoRA -------------------------------------------------------------------------------------

nn::LlamaConfig tiny_config() {
  nn::LlamaConfig c;
  c.vocab_size = 64;
  c.hidden_size = 64;
  c.intermediate_size = 128;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.max_seq_len = 32;
  c.init_std = 0.05f;
  return c;
}

std::unique_ptr<nn::LlamaModel> tiny_model(uint64_t seed = 3) {
  auto m = std::make_unique<nn::LlamaModel>(tiny_config(), Device::cpu());
  m->init_weights(seed);
  return m;
}

struct Batch {
  Tensor ids, targets;
};

Batch fixed_batch(int64_t b = 2, int64_t s = 16) {
  std::vector<int64_t> ids(static_cast<size_t>(b * s)), targets(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    ids[i] = static_cast<int64_t>((i * 7 + 3) % 64);
    targets[i] = static_cast<int64_t>((i * 7 + 10) % 64);
  }
  return {from_ints(ids, {b, s}), from_ints(targets, {b, s})};
}

float loss_of(nn::LlamaModel& m, const Batch& batch) {
  autograd::NoGrad no_grad;
  return m.loss_sum(batch.ids, batch.targets).item();
}

nn::LoraOptions options(nn::BaseQuantization quant, int64_t r = 4, float alpha = 16) {
  nn::LoraOptions o;
  o.r = r;
  o.alpha = alpha;
  o.quantize_base = quant;
  o.seed = 99;
  return o;
}

nn::Linear& projection(nn::DecoderLayer& layer, const std::string& name) {
  const bool attention =
      name == "q_proj" || name == "k_proj" || name == "v_proj" || name == "o_proj";
  return attention ? layer.self_attn.projection(name) : layer.mlp.projection(name);
}

void randomize_b(nn::LlamaModel& m, uint64_t seed) {
  Generator gen(seed);
  autograd::NoGrad no_grad;
  for (auto& [name, lora] : nn::lora_modules(m))
    lora->lora_B.copy_from(randn(lora->lora_B.shape(), gen, 0.05f));
}

TEST(Lora, ZeroBGivesTheBaseModelsLoss) {
  const Batch batch = fixed_batch();
  auto base = tiny_model();
  const float base_loss = loss_of(*base, batch);

  auto plain = tiny_model();
  nn::LoraSummary s = nn::apply_lora(*plain, options(nn::BaseQuantization::None));
  EXPECT_EQ(s.adapted_modules, 14);
  EXPECT_EQ(s.nf4_bytes, 0);
  const float plain_loss = loss_of(*plain, batch);
  EXPECT_EQ(std::memcmp(&plain_loss, &base_loss, sizeof(float)), 0)
      << plain_loss << " vs " << base_loss;

  // NF4: the same as a dense model holding the dequantized weights.
  auto quantized = tiny_model();
  auto reference = tiny_model();
  {
    autograd::NoGrad no_grad;
    for (auto& layer : reference->layers)
      for (const std::string& name : nn::lora_projection_names()) {
        nn::Linear& p = projection(*layer, name);
        p.weight.copy_from(nn::Nf4Tensor::quantize(p.weight).dequantize());
      }
  }
  s = nn::apply_lora(*quantized, options(nn::BaseQuantization::Nf4));
  EXPECT_GT(s.nf4_bytes, 0);
  const float nf4_loss = loss_of(*quantized, batch), ref_loss = loss_of(*reference, batch);
  EXPECT_EQ(std::memcmp(&nf4_loss, &ref_loss, sizeof(float)), 0) << nf4_loss << " vs " << ref_loss;
  EXPECT_NEAR(nf4_loss, base_loss, 0.02 * base_loss);
}

TEST(Lora, AdapterGradientsPassGradcheck) {
  Generator gen(31);
  for (nn::BaseQuantization quant : {nn::BaseQuantization::None, nn::BaseQuantization::Nf4}) {
    for (float dropout : {0.0f, 0.3f}) {
      auto dense = std::make_unique<nn::Linear>(10, 12, Device::cpu());
      dense->weight.copy_from(randn({12, 10}, gen, 0.3f));
      autograd::set_requires_grad(dense->weight, false);
      std::unique_ptr<nn::Linear> base = std::move(dense);
      if (quant == nn::BaseQuantization::Nf4) base = nn::Nf4Linear::from_linear(*base);
      nn::LoraLinear lora(std::move(base), 3, 6.0f, dropout, 5, Device::cpu());
      {
        autograd::NoGrad no_grad;
        lora.lora_B.copy_from(randn({12, 3}, gen, 0.5f));
      }
      Tensor x = testing::param({2, 4, 10}, gen);
      // The dropout mask is fixed by resetting its generator before each evaluation.
      gradcheck(
          [&](const std::vector<Tensor>& t) {
            lora.dropout_generator().set_state(1234, 0);
            return lora.forward(t[0]);
          },
          {x, lora.lora_A, lora.lora_B});
    }
  }
}

// Inverted dropout: a kept input is scaled by 1 / (1 - p), so the adapter's input keeps its
// expected value. With a zero base and identity adapters (r = alpha = n: scale 1), the output of
// an input of ones is the dropout itself.
TEST(Lora, DropoutKeepsTheExpectedValueOfItsInput) {
  const int64_t n = 16, rows = 6250;  // 100 000 draws
  const float p = 0.3f;
  auto base = std::make_unique<nn::Linear>(n, n, Device::cpu());
  base->weight.copy_from(zeros({n, n}, DType::F32));
  autograd::set_requires_grad(base->weight, false);
  nn::LoraLinear lora(std::move(base), n, static_cast<float>(n), p, 5, Device::cpu());
  std::vector<float> eye(static_cast<size_t>(n * n), 0.0f);
  for (int64_t i = 0; i < n; ++i) eye[static_cast<size_t>(i * n + i)] = 1.0f;
  {
    autograd::NoGrad no_grad;
    lora.lora_A.copy_from(from_floats(eye, {n, n}));
    lora.lora_B.copy_from(from_floats(eye, {n, n}));
  }
  ASSERT_TRUE(lora.is_training());
  const std::vector<float> out =
      lora.forward(from_floats(std::vector<float>(static_cast<size_t>(rows * n), 1.0f), {rows, n}))
          .to_float_vector();
  int64_t dropped = 0;
  double sum = 0;
  for (float v : out) {
    ASSERT_TRUE(v == 0.0f || std::abs(v - 1.0f / (1.0f - p)) < 1e-6f) << v;
    dropped += v == 0.0f ? 1 : 0;
    sum += v;
  }
  const double count = static_cast<double>(out.size());
  EXPECT_NEAR(static_cast<double>(dropped) / count, p, 0.01);
  EXPECT_NEAR(sum / count, 1.0, 0.01);
}

TEST(Lora, OnlyAdaptersReceiveGradients) {
  auto m = tiny_model();
  nn::LoraSummary s = nn::apply_lora(*m, options(nn::BaseQuantization::Nf4, 4, 8));
  const nn::LlamaConfig c = tiny_config();
  const int64_t kv = c.num_kv_heads * c.head_dim();
  const int64_t per_layer =
      4 * ((64 + 64) + (64 + kv) + (64 + kv) + (64 + 64) + (64 + 128) + (64 + 128) + (128 + 64));
  EXPECT_EQ(s.trainable_parameters, 2 * per_layer);
  EXPECT_EQ(s.trainable_parameters + s.frozen_parameters,
            c.num_parameters() + s.trainable_parameters);
  randomize_b(*m, 41);
  const Batch batch = fixed_batch();
  autograd::backward(m->loss_sum(batch.ids, batch.targets));
  int adapters = 0;
  for (auto& [name, slot] : m->named_parameters()) {
    const bool adapter = name.find(".lora_") != std::string::npos;
    EXPECT_EQ(autograd::requires_grad(*slot), adapter) << name;
    Tensor g = autograd::grad(*slot);
    EXPECT_EQ(g.defined(), adapter) << name;
    if (adapter) {
      ++adapters;
      EXPECT_GT(ops::sum_squares(g), 0.0) << name;
    }
  }
  EXPECT_EQ(adapters, 28);
}

// With adapter dropout, a strategy that recomputes a layer's forward in backward must draw the
// masks the first forward drew: every strategy gives the gradients of none, bit for bit (and
// leaves the generators where none leaves them, so the next step's masks agree too).
TEST(Lora, DropoutMasksAreReplayedByEveryRecomputingStrategy) {
  const Batch batch = fixed_batch();
  auto run = [&](const std::string& strategy, bool reentrant) {
    auto m = tiny_model();
    nn::LoraOptions o = options(nn::BaseQuantization::None, 4, 8);
    o.dropout = 0.5f;
    nn::apply_lora(*m, o);
    randomize_b(*m, 41);
    activation::ActivationOptions a;
    a.strategy = strategy;
    a.reentrant = reentrant;
    activation::apply_activation_strategy(*m, a);
    std::map<std::string, std::vector<float>> grads;
    for (int step = 0; step < 2; ++step) {
      autograd::backward(m->loss_sum(batch.ids, batch.targets));
      for (auto& [name, slot] : m->named_parameters()) {
        Tensor g = autograd::grad(*slot);
        if (!g.defined()) continue;
        grads[std::to_string(step) + ":" + name] = g.to_float_vector();
        autograd::set_grad(*slot, Tensor());
      }
    }
    return grads;
  };
  const auto reference = run("none", false);
  ASSERT_EQ(reference.size(), 2u * 28u);
  for (const std::string& strategy : activation::activation_strategies())
    for (bool reentrant : {false, true}) {
      SCOPED_TRACE(strategy + (reentrant ? " reentrant" : ""));
      const auto got = run(strategy, reentrant);
      ASSERT_EQ(got.size(), reference.size());
      for (const auto& [name, g] : reference) EXPECT_EQ(got.at(name), g) << name;
    }
}

TEST(Lora, FrozenDtypeAndValidation) {
  auto m = tiny_model();
  nn::LoraOptions o = options(nn::BaseQuantization::Nf4);
  o.frozen_dtype = DType::BF16;
  o.target_modules = {"q_proj", "v_proj"};
  nn::LoraSummary s = nn::apply_lora(*m, o);
  EXPECT_EQ(s.adapted_modules, 4);
  EXPECT_EQ(m->embed_tokens.weight.dtype(), DType::BF16);
  EXPECT_EQ(m->norm.weight.dtype(), DType::BF16);
  EXPECT_EQ(nn::lora_modules(*m).front().second->lora_A.dtype(), DType::F32);
  // Non-targeted projections are quantized too.
  EXPECT_NE(dynamic_cast<nn::Nf4Linear*>(&projection(*m->layers[0], "up_proj")), nullptr);
  const Batch batch = fixed_batch();
  Tensor loss = m->loss_sum(batch.ids, batch.targets);
  EXPECT_TRUE(std::isfinite(loss.item()));
  autograd::backward(loss);

  expect_error<ConfigError>([&] { nn::apply_lora(*m, o); }, {"already has a LoRA adapter"});
  auto fresh = tiny_model();
  o.target_modules = {"q_prj"};
  expect_error<ConfigError>([&] { nn::apply_lora(*fresh, o); },
                            {"lora.target_modules", "q_prj", "did you mean 'q_proj'"});
  o = options(nn::BaseQuantization::None, 0);
  expect_error<ConfigError>([&] { nn::apply_lora(*fresh, o); }, {"lora.r"});
  expect_error<ConfigError>([] { nn::parse_base_quantization("int4"); },
                            {"lora.quantize_base", "int4"});
}

// ---- PEFT files ---------------------------------------------------------------------------------

TEST(Peft, AdapterFilesHavePeftNamesAndConfigKeys) {
  TempDir dir;
  auto m = tiny_model();
  nn::apply_lora(*m, options(nn::BaseQuantization::Nf4, 4, 16));
  randomize_b(*m, 43);
  io::save_peft_adapter(*m, dir.str("adapter"), "meta-llama/Llama-3.1-8B");

  SafetensorsFile file = SafetensorsFile::open(dir.str("adapter/adapter_model.safetensors"));
  std::vector<std::string> expected;
  for (int l = 0; l < 2; ++l)
    for (const char* p : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                          "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"})
      for (const char* ab : {"lora_A", "lora_B"})
        expected.push_back("base_model.model.model.layers." + std::to_string(l) + "." + p + "." +
                           ab + ".weight");
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(file.names(), expected);
  EXPECT_EQ(file.info("base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight").shape,
            (Shape{4, 64}));
  EXPECT_EQ(file.info("base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight").shape,
            (Shape{32, 4}));
  EXPECT_EQ(file.info("base_model.model.model.layers.0.mlp.down_proj.lora_A.weight").dtype,
            DType::F32);
  EXPECT_EQ(file.metadata().at("format"), "pt");

  std::ifstream in(dir.str("adapter/adapter_config.json"));
  const nlohmann::json config = nlohmann::json::parse(in);
  std::set<std::string> keys;
  for (auto it = config.begin(); it != config.end(); ++it) keys.insert(it.key());
  EXPECT_EQ(keys,
            (std::set<std::string>{"peft_type", "task_type", "r", "lora_alpha", "lora_dropout",
                                   "target_modules", "base_model_name_or_path", "bias",
                                   "fan_in_fan_out", "inference_mode", "init_lora_weights",
                                   "modules_to_save", "revision", "use_rslora", "use_dora"}));
  EXPECT_EQ(config["peft_type"], "LORA");
  EXPECT_EQ(config["task_type"], "CAUSAL_LM");
  EXPECT_EQ(config["r"], 4);
  EXPECT_TRUE(config["lora_alpha"].is_number_integer());
  EXPECT_EQ(config["lora_alpha"], 16);
  EXPECT_EQ(config["lora_dropout"], 0);
  EXPECT_EQ(config["target_modules"], nlohmann::json({"q_proj", "k_proj", "v_proj", "o_proj",
                                                      "gate_proj", "up_proj", "down_proj"}));
  EXPECT_EQ(config["base_model_name_or_path"], "meta-llama/Llama-3.1-8B");
  EXPECT_EQ(config["bias"], "none");
  EXPECT_EQ(config["fan_in_fan_out"], false);
  EXPECT_EQ(config["inference_mode"], true);
  EXPECT_TRUE(config["modules_to_save"].is_null());
  EXPECT_EQ(config["use_dora"], false);

  // Round trip into a fresh model built from the config.
  std::string base_name;
  nn::LoraOptions read = io::read_peft_config(dir.str("adapter"), &base_name);
  EXPECT_EQ(base_name, "meta-llama/Llama-3.1-8B");
  EXPECT_EQ(read.r, 4);
  EXPECT_EQ(read.alpha, 16.0f);
  EXPECT_EQ(read.target_modules, nn::lora_projection_names());
  auto other = tiny_model();
  nn::apply_lora(*other, read);
  io::load_peft_adapter(*other, dir.str("adapter"));
  const Batch batch = fixed_batch();
  const float a = loss_of(*m, batch), b = loss_of(*other, batch);
  EXPECT_EQ(std::memcmp(&a, &b, sizeof(float)), 0);
}

TEST(Peft, LoadErrorsNameTheFileAndTensor) {
  TempDir dir;
  auto m = tiny_model();
  nn::apply_lora(*m, options(nn::BaseQuantization::None, 4, 16));
  io::save_peft_adapter(*m, dir.str("adapter"));
  const std::string weights = dir.str("adapter/adapter_model.safetensors");

  // A missing tensor.
  {
    SafetensorsFile file = SafetensorsFile::open(weights);
    NamedTensors kept;
    for (const std::string& name : file.names())
      if (name.find("layers.1.mlp.up_proj.lora_B") == std::string::npos)
        kept.emplace_back(name, file.load(name));
    fs::create_directories(dir.str("missing"));
    fs::copy_file(dir.str("adapter/adapter_config.json"), dir.str("missing/adapter_config.json"));
    save_safetensors(dir.str("missing/adapter_model.safetensors"), kept);
  }
  expect_error<FormatError>([&] { io::load_peft_adapter(*m, dir.str("missing")); },
                            {"missing/adapter_model.safetensors",
                             "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"});

  // A model with another rank.
  auto r8 = tiny_model();
  nn::apply_lora(*r8, options(nn::BaseQuantization::None, 8, 16));
  expect_error<FormatError>([&] { io::load_peft_adapter(*r8, dir.str("adapter")); },
                            {"adapter_config.json", "r=4", "rank 8"});

  // A model with fewer adapters than the file.
  auto fewer = tiny_model();
  nn::LoraOptions o = options(nn::BaseQuantization::None, 4, 16);
  o.target_modules = {"q_proj", "v_proj"};
  nn::apply_lora(*fewer, o);
  expect_error<FormatError>(
      [&] { io::load_peft_adapter(*fewer, dir.str("adapter")); },
      {"adapter_model.safetensors", "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight",
       "no adapter of this model"});

  // Unsupported PEFT features.
  {
    std::ifstream in(dir.str("adapter/adapter_config.json"));
    nlohmann::json config = nlohmann::json::parse(in);
    config["use_dora"] = true;
    fs::create_directories(dir.str("dora"));
    std::ofstream(dir.str("dora/adapter_config.json")) << config.dump();
  }
  expect_error<FormatError>([&] { io::read_peft_config(dir.str("dora")); },
                            {"dora/adapter_config.json", "use_dora"});
  expect_error<ConfigError>([&] { io::read_peft_config(dir.str("nowhere")); },
                            {"nowhere/adapter_config.json"});
  // A base model name that is no string is a damaged config, not "no base recorded".
  {
    std::ifstream in(dir.str("adapter/adapter_config.json"));
    nlohmann::json config = nlohmann::json::parse(in);
    config["base_model_name_or_path"] = 5;
    fs::create_directories(dir.str("base-number"));
    std::ofstream(dir.str("base-number/adapter_config.json")) << config.dump();
  }
  expect_error<FormatError>([&] { io::read_peft_config(dir.str("base-number")); },
                            {"base-number/adapter_config.json", "base_model_name_or_path",
                             "must be a string or null, got 5"});

  // Integer adapter tensors, and NaN in one: refused by name, with the model left as it was.
  auto rewritten = [&](const std::string& name, auto&& change) {
    SafetensorsFile file = SafetensorsFile::open(weights);
    NamedTensors tensors;
    for (const std::string& n : file.names()) {
      Tensor t = file.load(n);
      if (n.find("layers.0.self_attn.q_proj.lora_A") != std::string::npos) t = change(t);
      tensors.emplace_back(n, t);
    }
    fs::create_directories(dir.str(name));
    fs::copy_file(dir.str("adapter/adapter_config.json"), dir.str(name + "/adapter_config.json"));
    save_safetensors(dir.str(name + "/adapter_model.safetensors"), tensors);
  };
  rewritten("int", [](const Tensor& t) { return t.to(DType::I32); });
  expect_error<FormatError>(
      [&] { io::load_peft_adapter(*m, dir.str("int")); },
      {"int/adapter_model.safetensors", "layers.0.self_attn.q_proj.lora_A.weight", "I32",
       "adapter weights must be F32, BF16 or F16"});
  const std::vector<float> before = nn::lora_modules(*m).back().second->lora_B.to_float_vector();
  rewritten("nan", [](const Tensor& t) {
    std::vector<float> v = t.to_float_vector();
    v[3] = std::nanf("");
    return from_floats(v, t.shape());
  });
  expect_error<FormatError>([&] { io::load_peft_adapter(*m, dir.str("nan")); },
                            {"nan/adapter_model.safetensors",
                             "layers.0.self_attn.q_proj.lora_A.weight", "NaN or infinite"});
  EXPECT_EQ(nn::lora_modules(*m).back().second->lora_B.to_float_vector(), before)
      << "a refused adapter changed the model";
}

// An adapter installed in a model in eval mode evaluates: its dropout is off.
TEST(Lora, AdaptersTakeTheModelsTrainingMode) {
  auto m = tiny_model();
  m->train(false);
  nn::LoraOptions o = options(nn::BaseQuantization::None);
  o.dropout = 0.5f;
  nn::apply_lora(*m, o);
  for (auto& [name, lora] : nn::lora_modules(*m)) EXPECT_FALSE(lora->is_training()) << name;
  m->train(true);
  for (auto& [name, lora] : nn::lora_modules(*m)) EXPECT_TRUE(lora->is_training()) << name;
}

TEST(Peft, MergedExportComputesWhatTheAdaptedModelComputes) {
  TempDir dir;
  auto m = tiny_model();
  nn::apply_lora(*m, options(nn::BaseQuantization::Nf4, 4, 16));
  randomize_b(*m, 47);
  io::save_merged_hf_model(*m, dir.str("merged"));
  nn::LlamaModel merged(tiny_config(), Device::cpu());
  io::load_hf_weights(merged, dir.str("merged"));
  const Batch batch = fixed_batch();
  autograd::NoGrad no_grad;
  const std::vector<float> a = m->forward(batch.ids).to_float_vector();
  const std::vector<float> b = merged.forward(batch.ids).to_float_vector();
  ASSERT_EQ(a.size(), b.size());
  double max_diff = 0, max_abs = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs(static_cast<double>(a[i]) - b[i]);
    if (!(d <= max_diff)) max_diff = std::isnan(d) ? INFINITY : d;  // a NaN fails the check
    max_abs = std::max(max_abs, static_cast<double>(std::fabs(a[i])));
  }
  EXPECT_LT(max_diff, 1e-4 * max_abs);
  // The adapters matter: the base alone computes something else.
  auto base_only = tiny_model();
  const std::vector<float> c = base_only->forward(batch.ids).to_float_vector();
  double base_diff = 0;
  for (size_t i = 0; i < a.size(); ++i)
    base_diff = std::max(base_diff, static_cast<double>(std::fabs(a[i] - c[i])));
  EXPECT_GT(base_diff, 100 * max_diff);

  // In bf16 (train.export_dtype) the merged weights are the fp32 ones rounded, and config.json
  // says bfloat16.
  io::save_merged_hf_model(*m, dir.str("merged-bf16"), DType::BF16);
  const SafetensorsCheckpoint f32 = SafetensorsCheckpoint::open(dir.str("merged"));
  const SafetensorsCheckpoint bf16 = SafetensorsCheckpoint::open(dir.str("merged-bf16"));
  ASSERT_EQ(bf16.names(), f32.names());
  for (const std::string& name : f32.names()) {
    ASSERT_EQ(bf16.info(name).dtype, DType::BF16) << name;
    const std::vector<float> want = f32.load(name, Device::host()).to_float_vector();
    const std::vector<float> have = bf16.load(name, Device::host()).to_float_vector();
    ASSERT_EQ(have.size(), want.size()) << name;
    for (size_t i = 0; i < want.size(); ++i)
      ASSERT_EQ(have[i], bf16_to_float(float_to_bf16(want[i]))) << name << "[" << i << "]";
  }
  std::ifstream config_json(dir.str("merged-bf16") + "/config.json");
  const std::string text((std::istreambuf_iterator<char>(config_json)), {});
  EXPECT_NE(text.find("\"torch_dtype\": \"bfloat16\""), std::string::npos) << text;
}

TEST(Peft, Nf4BaseRoundTrip) {
  TempDir dir;
  auto m = tiny_model(3);
  nn::apply_lora(*m, options(nn::BaseQuantization::Nf4));
  io::save_nf4_base(*m, dir.str("base.safetensors"));
  auto other = tiny_model(3);
  nn::apply_lora(*other, options(nn::BaseQuantization::Nf4));
  Generator gen(53);
  for (auto& [module, lora] : nn::lora_modules(*other)) {
    auto& base = dynamic_cast<nn::Nf4Linear&>(lora->base());
    base.set_quantized_weight(
        nn::Nf4Tensor::quantize(randn(base.quantized_weight().shape, gen, 0.05f)));
  }
  const Batch batch = fixed_batch();
  ASSERT_NE(loss_of(*m, batch), loss_of(*other, batch));
  io::load_nf4_base(*other, dir.str("base.safetensors"));
  const float a = loss_of(*m, batch), b = loss_of(*other, batch);
  EXPECT_EQ(std::memcmp(&a, &b, sizeof(float)), 0);

  auto plain = tiny_model();
  nn::apply_lora(*plain, options(nn::BaseQuantization::None));
  expect_error<ConfigError>([&] { io::load_nf4_base(*plain, dir.str("base.safetensors")); },
                            {"no NF4 projections"});
}

// ---- shipped configs ---------------------------------------------------------------------------

nn::LlamaConfig llama_config_of(const train::ModelConfig& m) {
  nn::LlamaConfig c;
  c.vocab_size = m.vocab_size;
  c.hidden_size = m.hidden_size;
  c.intermediate_size = m.intermediate_size;
  c.num_layers = m.num_layers;
  c.num_heads = m.num_heads;
  c.num_kv_heads = m.effective_num_kv_heads();
  c.max_seq_len = m.max_seq_len;
  c.tie_embeddings = m.tie_embeddings;
  return c;
}

TEST(QloraConfigs, ShippedConfigsDescribeQloraRuns) {
  const std::string dir = std::string(SHARDTRAIN_SOURCE_DIR) + "/configs/";
  const train::Config big = train::load_config(dir + "qlora-llama-3.1-8b.yaml");
  EXPECT_TRUE(big.lora.enabled);
  EXPECT_EQ(big.lora.r, 32);
  EXPECT_EQ(big.lora.alpha, 16.0);
  EXPECT_EQ(big.lora.quantize_base, "nf4");
  EXPECT_EQ(big.lora.target_modules, nn::lora_projection_names());
  EXPECT_EQ(big.train.seq_len, 4096);
  EXPECT_EQ(big.train.micro_batch, 2);
  EXPECT_EQ(big.precision.compute, "bf16");
  EXPECT_EQ(big.activation.strategy, "per_layer");
  // The sizes docs/qlora.md quotes: 83,886,080 adapter parameters, 3,600,416,768 NF4 bytes.
  const nn::LlamaConfig c = llama_config_of(big.model);
  const int64_t h = c.hidden_size, kv = c.num_kv_heads * c.head_dim(), i = c.intermediate_size;
  const int64_t adapter = big.lora.r * (2 * (h + h) + 2 * (h + kv) + 3 * (h + i)) * c.num_layers;
  EXPECT_EQ(adapter, 83886080);
  const int64_t projection_weights = (2 * h * h + 2 * h * kv + 3 * h * i) * c.num_layers;
  EXPECT_EQ(projection_weights, 6979321856);
  EXPECT_EQ(projection_weights / 2 + projection_weights / 64 + 4 * projection_weights / 64 / 256,
            3600416768);

  // The tiny config builds, adapts and trains.
  const train::Config tiny = train::load_config(dir + "qlora-tiny.yaml");
  ASSERT_TRUE(tiny.lora.enabled);
  nn::LlamaModel m(llama_config_of(tiny.model), Device::cpu());
  m.init_weights(static_cast<uint64_t>(tiny.train.seed));
  nn::LoraOptions o;
  o.r = tiny.lora.r;
  o.alpha = static_cast<float>(tiny.lora.alpha);
  o.dropout = static_cast<float>(tiny.lora.dropout);
  o.target_modules = tiny.lora.target_modules;
  o.quantize_base = nn::parse_base_quantization(tiny.lora.quantize_base);
  const nn::LoraSummary s = nn::apply_lora(m, o);
  EXPECT_EQ(s.adapted_modules, 4 * 7);
  EXPECT_LT(s.trainable_parameters, s.frozen_parameters / 5);
  std::vector<int64_t> ids(2 * 64);
  for (size_t k = 0; k < ids.size(); ++k) ids[k] = static_cast<int64_t>((k * 31) % 256);
  Tensor loss = m.loss_sum(from_ints(ids, {2, 64}), from_ints(ids, {2, 64}));
  autograd::backward(loss);
  EXPECT_TRUE(std::isfinite(loss.item()));
}

// ---- training -----------------------------------------------------------------------------------

TEST(Lora, AdamWStepsLowerTheLoss) {
  auto m = tiny_model();
  nn::LoraOptions o = options(nn::BaseQuantization::Nf4, 8, 16);
  o.dropout = 0.05f;
  nn::apply_lora(*m, o);
  std::vector<optim::NamedParam> params;
  for (auto& [name, slot] : m->named_parameters())
    if (autograd::requires_grad(*slot)) params.push_back({name, slot});
  ASSERT_EQ(params.size(), 28u);
  optim::AdamWOptions ao;
  ao.weight_decay = 0.0f;
  optim::AdamW adamw(params, ao);
  const Batch batch = fixed_batch();
  m->train(false);
  const float first = loss_of(*m, batch);
  m->train(true);
  for (int step = 0; step < 8; ++step) {
    adamw.zero_grad();
    int64_t counted = 0;
    Tensor loss = m->loss_sum(batch.ids, batch.targets, &counted);
    autograd::backward(ops::scale(loss, 1.0f / static_cast<float>(counted)));
    adamw.step(1e-2f);
  }
  m->train(false);
  const float last = loss_of(*m, batch);
  std::printf("LoRA loss %.4f -> %.4f\n", first, last);
  EXPECT_LT(last, 0.8f * first);
}

// lora.init_from: a run's adapters start as the saved adapter's, bit for bit (instead of A random
// and B zero); an adapter of another shape or of another base is refused, naming the keys to set.
TEST(Lora, ARunStartsFromASavedPeftAdapter) {
  TempDir dir;
  auto config = [&](std::vector<std::string> overrides) {
    overrides.insert(overrides.begin(), {"lora.enabled=true", "lora.r=4", "lora.alpha=8",
                                         "train.out_dir=" + dir.str("run")});
    return train::Config::parse(testing::kTinyRunYaml, overrides, "test_qlora");
  };
  auto adapters = [](nn::LlamaModel& m) {
    std::vector<float> values;
    for (auto& [name, lora] : nn::lora_modules(m))
      for (const Tensor* t : {&lora->lora_A, &lora->lora_B}) {
        const std::vector<float> v = t->to_float_vector();
        values.insert(values.end(), v.begin(), v.end());
      }
    return values;
  };
  std::vector<float> saved_values;
  {
    train::Runtime saved(config({"train.seed=11"}));  // other adapters than seed 7's fresh ones
    randomize_b(saved.model(), 5);
    saved_values = adapters(saved.model());
    io::save_peft_adapter(saved.model(), dir.str("adapter"));
  }
  const std::string from = "lora.init_from=" + dir.str("adapter");
  {
    train::Runtime fresh(config({}));
    EXPECT_FALSE(bitwise_equal(adapters(fresh.model()), saved_values));
    train::Runtime started(config({from}));
    EXPECT_TRUE(bitwise_equal(adapters(started.model()), saved_values));
  }
  expect_error<ConfigError>(
      [&] {
        train::Runtime r(config({from, "lora.r=8"}));
      },
      {"lora.init_from", "has r 4 (lora.r is 8)", "set lora.r"});
  expect_error<ConfigError>(
      [&] {
        train::Runtime r(config({from, "lora.target_modules=[q_proj, v_proj]"}));
      },
      {"target_modules [down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj]",
       "(lora.target_modules is [q_proj, v_proj])"});
  expect_error<ConfigError>(
      [&] {
        train::Config c = config({from, "lora.enabled=false"});
      },
      {"lora.init_from", "lora.enabled is false"});
  // An adapter whose recorded base is a model directory, other weights than this run's base...
  const std::string golden = std::string(SHARDTRAIN_TEST_DATA) + "/golden/llama-tiny-gqa";
  {
    std::ifstream in(dir.str("adapter/adapter_config.json"));
    nlohmann::json peft = nlohmann::json::parse(in);
    peft["base_model_name_or_path"] = golden;
    fs::create_directories(dir.str("elsewhere"));
    fs::copy_file(dir.str("adapter/adapter_model.safetensors"),
                  dir.str("elsewhere/adapter_model.safetensors"));
    std::ofstream(dir.str("elsewhere/adapter_config.json")) << peft.dump();
  }
  expect_error<ConfigError>(
      [&] { train::Runtime r(config({"lora.init_from=" + dir.str("elsewhere")})); },
      {"was trained on the base model in '" + golden + "'",
       "initialised from train.seed (no model.from_hf)", "set lora.base_model"});
  // ... and a copy of the base directory is the same base: the weights decide, not the path.
  auto golden_config = [&](const std::string& from_hf, const std::string& init_from) {
    std::vector<std::string> sets = {"lora.enabled=true", "lora.r=4", "train.device=cpu",
                                     "train.out_dir=" + dir.str("golden-run")};
    if (!init_from.empty()) sets.push_back("lora.init_from=" + init_from);
    return train::Config::parse("model:\n  from_hf: " + from_hf + "\n", sets, "test_qlora");
  };
  {
    train::Runtime on_golden(golden_config(golden, ""));
    io::save_peft_adapter(on_golden.model(), dir.str("golden-adapter"), golden);
  }
  fs::copy(golden, dir.str("golden-copy"), fs::copy_options::recursive);
  EXPECT_NO_THROW(train::Runtime(golden_config(dir.str("golden-copy"), dir.str("golden-adapter"))));
  // An adapter directory whose weights file is missing is refused before the base loads.
  fs::remove(dir.str("golden-adapter/adapter_model.safetensors"));
  expect_error<ConfigError>(
      [&] { train::Runtime r(golden_config(golden, dir.str("golden-adapter"))); },
      {"lora.init_from: ", "adapter_model.safetensors"});
}

// ---- building the NF4 base ---------------------------------------------------------------------

// A run builds its NF4 base one projection at a time on the host (random here, as without
// lora.base_model): the bits of initialising the whole model and quantizing it, in a fraction of
// the memory of the dense model, which never exists whole.
TEST(QloraRuntime, BuildsItsNf4BaseOneProjectionAtATime) {
  TempDir dir;
  const nn::LlamaConfig c = tiny_config();
  const std::string yaml =
      "model:\n  vocab_size: 64\n  hidden_size: 64\n  intermediate_size: 128\n"
      "  num_layers: 2\n  num_heads: 4\n  num_kv_heads: 2\n  max_seq_len: 32\n"
      "  init_std: 0.05\n";
  Allocator& cpu = allocator_for(Device::cpu());
  const int64_t before = cpu.stats().total_in_use;
  cpu.reset_peak();
  std::vector<std::pair<int64_t, int64_t>> told;  // the progress the trainer shows
  train::Runtime rt(
      train::Config::parse(yaml,
                           {"lora.enabled=true", "lora.r=4", "train.device=cpu", "train.seed=21",
                            "train.seq_len=32", "train.out_dir=" + dir.str("run")},
                           "test_qlora"),
      [&](int64_t done, int64_t total) { told.emplace_back(done, total); });
  const int64_t built_peak = cpu.stats().total_peak - before;
  ASSERT_EQ(told.size(), 14u);  // 2 layers x 7 projections, each told once, in order
  for (size_t i = 0; i < told.size(); ++i)
    EXPECT_EQ(told[i], std::make_pair(static_cast<int64_t>(i + 1), int64_t{14}));
  const int64_t dense_model = c.num_parameters() * 4;
  // Built whole, the dense fp32 model alone would have been the peak (its projections are 90%
  // of it); here the projections are NF4 but for one at a time (the rest is adapters, their
  // optimizer state and the dense embeddings, norms and head).
  EXPECT_LT(built_peak, dense_model) << "the dense fp32 model is " << dense_model << " bytes";

  auto whole = tiny_model(21);  // initialised whole, then quantized by apply_lora
  nn::apply_lora(*whole, options(nn::BaseQuantization::Nf4));
  for (int l = 0; l < 2; ++l)
    for (const std::string& name : nn::lora_projection_names()) {
      nn::Linear* p = &projection(*rt.model().layers[static_cast<size_t>(l)], name);
      nn::Linear* q = &projection(*whole->layers[static_cast<size_t>(l)], name);
      if (auto* lora = dynamic_cast<nn::LoraLinear*>(p)) p = &lora->base();
      if (auto* lora = dynamic_cast<nn::LoraLinear*>(q)) q = &lora->base();
      const auto* a = dynamic_cast<nn::Nf4Linear*>(p);
      const auto* b = dynamic_cast<nn::Nf4Linear*>(q);
      ASSERT_TRUE(a != nullptr && b != nullptr) << name;
      EXPECT_EQ(a->quantized_weight().codes.to_int_vector(),
                b->quantized_weight().codes.to_int_vector())
          << l << " " << name;
      EXPECT_EQ(a->quantized_weight().absmax_q.to_int_vector(),
                b->quantized_weight().absmax_q.to_int_vector())
          << l << " " << name;
      EXPECT_EQ(a->quantized_weight().absmax_offset, b->quantized_weight().absmax_offset);
    }
  // B = 0: both compute their base, the same bits.
  const Batch batch = fixed_batch();
  EXPECT_EQ(loss_of(rt.model(), batch), loss_of(*whole, batch));
}

// ---- bitsandbytes 4-bit checkpoints -----------------------------------------------------------

// Writes `m` as bitsandbytes saves a 4-bit model (io/bnb.h): every projection quantized (here by
// this runtime's quantizer, whose codes are bitsandbytes'), the other weights dense in bf16, and
// config.json with bitsandbytes' quantization_config. `edit_state` changes a weight's JSON
// quant state and `edit` the tensor list before they are written, to make damaged files.
void save_like_bitsandbytes(
    nn::LlamaModel& m, const std::string& dir,
    const std::function<void(const std::string&, nlohmann::json&)>& edit_state = {},
    const std::function<void(NamedTensors&)>& edit = {}) {
  NamedTensors tensors;
  for (auto& [name, slot] : m.named_parameters()) {
    const bool projection = name.find("_proj.weight") != std::string::npos;
    if (!projection) {
      tensors.emplace_back(name, slot->to(DType::BF16));
      continue;
    }
    const nn::Nf4Tensor q = nn::Nf4Tensor::quantize(*slot);
    tensors.emplace_back(name, q.codes.view({q.codes.numel(), 1}));
    tensors.emplace_back(name + ".absmax", q.absmax_q);
    tensors.emplace_back(name + ".nested_absmax", q.absmax_scale);
    tensors.emplace_back(
        name + ".quant_map",
        from_floats(std::vector<float>(nf4::kNf4Code.begin(), nf4::kNf4Code.end()), {16}));
    const auto& dynamic = nf4::dynamic_map_8bit();
    tensors.emplace_back(name + ".nested_quant_map",
                         from_floats(std::vector<float>(dynamic.begin(), dynamic.end()), {256}));
    nlohmann::json state = {{"quant_type", "nf4"},      {"blocksize", 64},
                            {"dtype", "bfloat16"},      {"shape", q.shape},
                            {"nested_blocksize", 256},  {"nested_offset", q.absmax_offset},
                            {"nested_dtype", "float32"}};
    if (edit_state) edit_state(name, state);
    const std::string text = state.dump();
    std::vector<int64_t> bytes(text.begin(), text.end());
    tensors.emplace_back(name + ".quant_state.bitsandbytes__nf4",
                         from_ints(bytes, {static_cast<int64_t>(bytes.size())}, DType::U8));
  }
  if (edit) edit(tensors);
  save_sharded(dir, tensors, int64_t{5} << 30, {{"format", "pt"}});
  nlohmann::json config = nlohmann::json::parse(m.config().to_hf_json(DType::BF16));
  config["quantization_config"] = {{"quant_method", "bitsandbytes"},
                                   {"load_in_4bit", true},
                                   {"bnb_4bit_quant_type", "nf4"},
                                   {"bnb_4bit_use_double_quant", true},
                                   {"bnb_4bit_compute_dtype", "bfloat16"}};
  std::ofstream(dir + "/config.json") << config.dump(2);
}

// The NF4 weight under a projection (adapted or not).
const nn::Nf4Tensor& nf4_base(nn::LlamaModel& m, int layer, const std::string& name) {
  nn::Linear* p = &projection(*m.layers[static_cast<size_t>(layer)], name);
  if (auto* lora = dynamic_cast<nn::LoraLinear*>(p)) p = &lora->base();
  auto* q = dynamic_cast<nn::Nf4Linear*>(p);
  if (q == nullptr) throw Error("not an NF4 projection");
  return q->quantized_weight();
}

// A QLoRA run on a bitsandbytes 4-bit checkpoint keeps its codes as they are stored: its base is
// the one a run on the dense (bf16) weights quantizes for itself, bit for bit, and so is its
// loss; the adapters train on it and save with it as their base.
TEST(BnbCheckpoint, IsTheNf4BaseOfAQloraRunAsStored) {
  TempDir dir;
  auto m = tiny_model(21);
  io::save_hf_model(*m, dir.str("dense"), int64_t{5} << 30, DType::BF16);
  auto rounded = std::make_unique<nn::LlamaModel>(tiny_config(), Device::cpu());
  io::load_hf_weights(*rounded, dir.str("dense"));  // the weights a bf16 release holds
  save_like_bitsandbytes(*rounded, dir.str("bnb"));

  auto run_config = [&](const std::string& from_hf, std::vector<std::string> sets = {}) {
    sets.insert(sets.end(), {"lora.enabled=true", "lora.r=4", "train.device=cpu",
                             "train.out_dir=" + dir.str("run")});
    return train::Config::parse("model:\n  from_hf: " + from_hf + "\n", sets, "test_qlora");
  };
  train::Runtime from_dense(run_config(dir.str("dense")));
  train::Runtime from_bnb(run_config(dir.str("bnb")));
  for (int l = 0; l < 2; ++l)
    for (const std::string& name : nn::lora_projection_names()) {
      const nn::Nf4Tensor& a = nf4_base(from_bnb.model(), l, name);
      const nn::Nf4Tensor& b = nf4_base(from_dense.model(), l, name);
      EXPECT_EQ(a.shape, b.shape) << name;
      EXPECT_EQ(a.codes.to_int_vector(), b.codes.to_int_vector()) << l << " " << name;
      EXPECT_EQ(a.absmax_q.to_int_vector(), b.absmax_q.to_int_vector()) << l << " " << name;
      EXPECT_TRUE(bitwise_equal(a.absmax_scale.to_float_vector(), b.absmax_scale.to_float_vector()))
          << l << " " << name;
      EXPECT_EQ(a.absmax_offset, b.absmax_offset) << l << " " << name;
    }
  const Batch batch = fixed_batch();
  const float loss = loss_of(from_bnb.model(), batch);
  EXPECT_TRUE(std::isfinite(loss));
  EXPECT_EQ(loss, loss_of(from_dense.model(), batch));
  // bitsandbytes computes its dynamic map in float32 (torch.linspace, float32 means): some of its
  // entries are one ulp from this runtime's. Such a file loads, and decodes with the runtime's map.
  save_like_bitsandbytes(*rounded, dir.str("bnb-float32-map"), {}, [](NamedTensors& tensors) {
    for (auto& [name, t] : tensors)
      if (name.ends_with(".nested_quant_map"))
        for (int64_t i = 0; i < t.numel(); i += 3)
          if (t.data<float>()[i] != 0.0f && std::fabs(t.data<float>()[i]) != 1.0f)
            t.data<float>()[i] = std::nextafter(t.data<float>()[i], 2.0f);
  });
  {
    train::Runtime from_float32_map(run_config(dir.str("bnb-float32-map")));
    EXPECT_EQ(loss_of(from_float32_map.model(), batch), loss);
  }
  // Packed codes stored as bf16 elements (bnb_4bit_quant_storage) are the same bytes.
  save_like_bitsandbytes(*rounded, dir.str("bnb-bf16-storage"), {}, [](NamedTensors& tensors) {
    for (auto& [name, t] : tensors)
      if (name.ends_with("_proj.weight")) {
        Tensor wide = empty({t.numel() / 2, 1}, DType::BF16, Device::cpu());
        std::memcpy(wide.data_ptr(), t.data_ptr(), static_cast<size_t>(t.nbytes()));
        t = wide;
      }
  });
  {
    train::Runtime from_bf16_storage(run_config(dir.str("bnb-bf16-storage")));
    EXPECT_EQ(loss_of(from_bf16_storage.model(), batch), loss);
  }
  // The same as loading the dense model whole and quantizing it in apply_lora.
  auto whole = std::make_unique<nn::LlamaModel>(tiny_config(), Device::cpu());
  io::load_hf_weights(*whole, dir.str("dense"));
  nn::apply_lora(*whole, options(nn::BaseQuantization::Nf4));
  EXPECT_EQ(loss, loss_of(*whole, batch));
  // Quantization matters: the dense bf16 model computes something else.
  EXPECT_NE(loss, loss_of(*rounded, batch));
}

// The runtime writes the layout bitsandbytes does (`shardtrain quantize`): byte for byte the file
// the test's own rendering of bitsandbytes' format gives for the same weights, and a run reads it
// back as the base it quantizes from the dense weights.
TEST(BnbCheckpoint, TheRuntimeWritesItsNf4BaseInBitsandbytesLayout) {
  TempDir dir;
  auto m = tiny_model(23);
  io::save_hf_model(*m, dir.str("dense"), int64_t{5} << 30, DType::BF16);
  auto rounded = std::make_unique<nn::LlamaModel>(tiny_config(), Device::cpu());
  io::load_hf_weights(*rounded, dir.str("dense"));
  save_like_bitsandbytes(*rounded, dir.str("reference"));

  nn::LlamaModel base(tiny_config(), Device::cpu(), nn::ParameterStorage::Deferred);
  std::vector<int64_t> told;
  io::load_nf4_base_from_hf(base, dir.str("dense"), [&](int64_t done, int64_t total) {
    told.push_back(done * 100 + total);
  });
  EXPECT_EQ(told.size(), 14u);
  EXPECT_EQ(told.back(), 14 * 100 + 14);
  io::save_bnb_4bit_model(base, dir.str("written"));
  EXPECT_TRUE(testing::read_file_bytes(dir.str("written/model.safetensors")) ==
              testing::read_file_bytes(dir.str("reference/model.safetensors")))
      << "the written tensors differ from bitsandbytes' layout";
  const nlohmann::json config =
      nlohmann::json::parse(testing::read_file_bytes(dir.str("written/config.json")));
  EXPECT_EQ(config["quantization_config"]["quant_method"], "bitsandbytes");
  EXPECT_EQ(config["quantization_config"]["load_in_4bit"], true);
  EXPECT_EQ(config["quantization_config"]["bnb_4bit_quant_type"], "nf4");
  EXPECT_EQ(config["quantization_config"]["bnb_4bit_use_double_quant"], true);
  EXPECT_EQ(config["torch_dtype"], "bfloat16");

  nn::LlamaModel again(tiny_config(), Device::cpu(), nn::ParameterStorage::Deferred);
  io::load_nf4_base_from_hf(again, dir.str("written"));
  const Batch batch = fixed_batch();
  EXPECT_EQ(loss_of(again, batch), loss_of(base, batch));
  // A model whose projections are dense is refused (an adapted one too: they are not NF4).
  expect_error<ConfigError>([&] { io::save_bnb_4bit_model(*rounded, dir.str("dense-out")); },
                            {"model.layers.0.self_attn.q_proj.weight is not an NF4 projection"});
}

// What the runtime cannot decode is refused before training, naming the tensor and the fix; a
// 4-bit checkpoint is never trained as dense weights.
TEST(BnbCheckpoint, RefusesWhatItCannotDecodeNamingTheTensorAndTheFix) {
  TempDir dir;
  auto m = tiny_model(21);
  const std::string q0 = "model.layers.0.self_attn.q_proj.weight";
  int variant = 0;
  auto refused = [&](const std::function<void(const std::string&, nlohmann::json&)>& edit_state,
                     const std::function<void(NamedTensors&)>& edit,
                     const std::vector<std::string>& parts) {
    const std::string path = dir.str("bad" + std::to_string(variant++));
    save_like_bitsandbytes(*m, path, edit_state, edit);
    auto fresh = tiny_model(1);
    try {
      io::load_nf4_base_from_hf(*fresh, path);
      ADD_FAILURE() << "no FormatError for " << parts.front();
    } catch (const FormatError& e) {
      for (const std::string& part : parts)
        EXPECT_NE(std::string(e.what()).find(part), std::string::npos)
            << "'" << part << "' not in: " << e.what();
    }
  };
  auto in_q0 = [&](const std::function<void(nlohmann::json&)>& change) {
    return [=](const std::string& name, nlohmann::json& state) {
      if (name == q0) change(state);
    };
  };
  auto rename = [&](const std::string& from, const std::string& to) {
    return [=](NamedTensors& tensors) {
      for (auto& [name, t] : tensors)
        if (name == from) name = to;
    };
  };
  refused({}, rename(q0 + ".quant_state.bitsandbytes__nf4", q0 + ".quant_state.bitsandbytes__fp4"),
          {"tensor '" + q0 + "'", "is quantized to FP4", "lora.base_model at the dense model"});
  refused(in_q0([](nlohmann::json& s) { s["blocksize"] = 128; }), {},
          {"tensor '" + q0 + "'", "has blocksize 128", "blocks are 64 weights"});
  refused(in_q0([](nlohmann::json& s) {
            s["shape"] = {64, 32};
          }),
          {}, {"tensor '" + q0 + "'", "has shape [64, 32] but the model expects [64, 64]"});
  refused({},
          [&](NamedTensors& tensors) {
            std::erase_if(tensors, [&](const auto& t) {
              return t.first == q0 + ".nested_absmax" || t.first == q0 + ".nested_quant_map";
            });
          },
          {"tensor '" + q0 + "'", "not double-quantized", "bnb_4bit_use_double_quant"});
  refused({},
          [&](NamedTensors& tensors) {
            for (auto& [name, t] : tensors)
              if (name == q0 + ".quant_map") t.data<float>()[3] = 0.25f;
          },
          {"tensor '" + q0 + "'", "quant_map that is not the NF4 table (value 3 is 0.25"});
  refused({},
          [&](NamedTensors& tensors) {
            for (auto& [name, t] : tensors)
              if (name == q0 + ".nested_quant_map") t.data<float>()[200] *= 1.001f;
          },
          {"tensor '" + q0 + "'", "nested_quant_map that is not bitsandbytes' dynamic 8-bit map"});
  refused({},
          [&](NamedTensors& tensors) {
            tensors.emplace_back("model.layers.0.extra.weight", from_floats({1.0f}, {1}));
          },
          {"have tensor 'model.layers.0.extra.weight' that this model does not"});

  // Trained as dense weights, or under a LoRA run that keeps a dense base: refused at load.
  save_like_bitsandbytes(*m, dir.str("bnb"));
  auto config = [&](std::vector<std::string> sets) {
    sets.insert(sets.end(), {"train.device=cpu", "train.out_dir=" + dir.str("run")});
    return train::Config::parse("model:\n  from_hf: " + dir.str("bnb") + "\n", sets, "test_qlora");
  };
  for (const std::vector<std::string>& sets :
       {std::vector<std::string>{}, {"lora.enabled=true", "lora.quantize_base=none"}})
    expect_error<ConfigError>([&] { train::Runtime r(config(sets)); },
                              {"holds weights quantized to 4 bits by bitsandbytes",
                               "lora.enabled: true with lora.quantize_base: nf4"});
}

}  // namespace
}  // namespace shardtrain
