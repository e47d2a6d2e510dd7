// The bench's measured activation memory for configs/tiny.yaml matches the analytic formulas of
// docs/activation-memory.md within 5%, for every strategy, in fp32 and bf16; its model FLOPs per
// token match a hand count, and its peaks and MFU the datasheet figures and the definition.
#include <gtest/gtest.h>

#include "shardtrain/activation/estimate.h"
#include "shardtrain/train/bench.h"
#include "shardtrain/train/config.h"
#include "shardtrain/train/runtime.h"

using namespace shardtrain;

TEST(BenchFormulas, ActivationPeaksOfTinyMatchTheFormulas) {
  for (const char* precision : {"fp32", "bf16"}) {
    for (const std::string strategy :
         {"none", "per_layer", "sqrt_segment", "selective", "offload", "offload_checkpoint"}) {
      train::Config c = train::load_config(
          std::string(SHARDTRAIN_SOURCE_DIR) + "/configs/tiny.yaml",
          {"train.device=cpu", "activation.strategy=" + strategy,
           std::string("precision.compute=") + precision, "train.progress=none"});
      train::BenchRow row = train::measure_config(c, /*warmup=*/0, /*steps=*/1);
      ASSERT_TRUE(row.ok()) << strategy << ": " << row.message;
      activation::ActivationModelShape shape;
      shape.batch = c.train.micro_batch;
      shape.seq = c.train.seq_len;
      shape.hidden = c.model.hidden_size;
      shape.heads = c.model.num_heads;
      shape.kv_heads = c.model.effective_num_kv_heads();
      shape.intermediate = c.model.intermediate_size;
      shape.vocab = c.model.vocab_size;
      shape.layers = c.model.num_layers;
      shape.dtype_bytes = std::string(precision) == "fp32" ? 4 : 2;
      int64_t predicted = activation::activation_bytes_model(strategy, shape).peak;
      int64_t measured = row.peak_by_category[static_cast<size_t>(MemoryCategory::Activations)];
      EXPECT_NEAR(static_cast<double>(measured), static_cast<double>(predicted),
                  0.05 * static_cast<double>(predicted))
          << precision << " " << strategy << ": measured " << measured << " predicted "
          << predicted;
    }
  }
}

// ---- model FLOPs per token and MFU --------------------------------------------------------------

namespace {

nn::LlamaConfig tiny_shape(bool tied) {
  nn::LlamaConfig m;
  m.vocab_size = 256;
  m.hidden_size = 32;
  m.intermediate_size = 88;
  m.num_layers = 2;
  m.num_heads = 4;
  m.num_kv_heads = 2;
  m.tie_embeddings = tied;
  return m;
}

}  // namespace

TEST(BenchFormulas, FlopsPerTokenOfATinyModelMatchesAHandCount) {
  // head_dim 8, so k and v project 32 -> 2 x 8 = 16.
  const int64_t q = 32 * 32, k = 32 * 16, v = 32 * 16, o = 32 * 32;
  const int64_t gate = 32 * 88, up = 32 * 88, down = 88 * 32;
  const int64_t norms = 2 * 32;
  const int64_t layer = q + k + v + o + gate + up + down + norms;
  ASSERT_EQ(layer, 11584);
  const int64_t head = 256 * 32, final_norm = 32;
  const int64_t n = 2 * layer + final_norm + head;  // the input embedding does no arithmetic
  EXPECT_EQ(n, 31392);
  EXPECT_EQ(train::flops_parameter_count(tiny_shape(false)), n);
  EXPECT_EQ(tiny_shape(false).num_parameters() - 256 * 32, n);
  EXPECT_EQ(train::flops_parameter_count(tiny_shape(true)), n) << "a tied table is the head";

  // Attention per token, layer and pass: scores q.k over 32 positions and the weighted sum of
  // 32 values, 2 FLOPs per multiply-add, over 4 heads x 8 dims; backward twice the forward.
  const double seq = 32;
  const double attention_forward = 2 * (2 * seq * 4 * 8);
  const double attention = 2 * 3 * attention_forward;  // 2 layers, forward + backward
  EXPECT_EQ(attention, 12.0 * 2 * 32 * 32);
  EXPECT_DOUBLE_EQ(train::model_flops_per_token(tiny_shape(false), 32), 6.0 * n + attention);
  EXPECT_DOUBLE_EQ(train::model_flops_per_token(tiny_shape(false), 32), 212928.0);
  // Doubling the sequence adds only attention FLOPs.
  EXPECT_DOUBLE_EQ(train::model_flops_per_token(tiny_shape(false), 64) -
                       train::model_flops_per_token(tiny_shape(false), 32),
                   attention);
}

TEST(BenchFormulas, FlopsPerTokenOfLlama1bUsesItsPublishedParameterCount) {
  train::Config c =
      train::load_config(std::string(SHARDTRAIN_SOURCE_DIR) + "/configs/llama-1b.yaml", {});
  nn::LlamaConfig m = train::llama_config_from(c.model);
  // Llama-3.2-1B: 1,235,814,400 parameters with the 128256 x 2048 table tied to the head.
  EXPECT_EQ(m.num_parameters(), 1235814400);
  EXPECT_EQ(train::flops_parameter_count(m), 1235814400);
  // + 12 x 16 layers x 2048 x 2048 positions.
  EXPECT_DOUBLE_EQ(train::model_flops_per_token(m, 2048), 6.0 * 1235814400 + 805306368.0);
}

TEST(BenchFormulas, PeakFromTheGpuNameAndPrecision) {
  const std::string h100 = "NVIDIA H100 80GB HBM3 (sm_90, 132 SMs, 79.1 GiB)";
  EXPECT_DOUBLE_EQ(train::peak_tflops_for_gpu(h100, "bf16"), 989.4);
  EXPECT_DOUBLE_EQ(train::peak_tflops_for_gpu(h100, "fp16"), 989.4);
  EXPECT_DOUBLE_EQ(train::peak_tflops_for_gpu(h100, "fp32"), 67.0);
  EXPECT_DOUBLE_EQ(train::peak_tflops_for_gpu("NVIDIA H200 (sm_90, 132 SMs)", "bf16"), 989.4);
  EXPECT_DOUBLE_EQ(train::peak_tflops_for_gpu("NVIDIA H100 PCIe", "bf16"), 756.5);
  EXPECT_DOUBLE_EQ(train::peak_tflops_for_gpu("NVIDIA H100 NVL", "bf16"), 835.5);
  EXPECT_DOUBLE_EQ(train::peak_tflops_for_gpu("NVIDIA A100-SXM4-80GB", "bf16"), 312.0);
  EXPECT_DOUBLE_EQ(train::peak_tflops_for_gpu("NVIDIA A100-SXM4-80GB", "fp32"), 19.5);
  EXPECT_EQ(train::peak_tflops_for_gpu("Tesla T4", "bf16"), 0.0);
  EXPECT_EQ(train::peak_tflops_for_gpu("", "bf16"), 0.0) << "a CPU has no default peak";
  EXPECT_EQ(train::peak_tflops_for_gpu(h100, "fp8"), 0.0);
}

TEST(BenchFormulas, ModelFlopsUtilization) {
  // 10,000 tokens/s x 1e9 FLOPs = 10 TFLOP/s.
  EXPECT_DOUBLE_EQ(train::model_flops_utilization(1e4, 1e9, 100.0, 1), 0.1);
  EXPECT_DOUBLE_EQ(train::model_flops_utilization(1e4, 1e9, 100.0, 2), 0.05);
  EXPECT_LT(train::model_flops_utilization(1e4, 1e9, 0.0, 1), 0.0) << "unknown peak";
}
