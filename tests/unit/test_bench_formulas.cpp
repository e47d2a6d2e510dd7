// The bench's measured activation memory for configs/tiny.yaml matches the analytic formulas of
// docs/activation-memory.md within 5%, for every strategy, in fp32 and bf16.
#include <gtest/gtest.h>

#include "shardtrain/activation/estimate.h"
#include "shardtrain/train/bench.h"
#include "shardtrain/train/config.h"

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
