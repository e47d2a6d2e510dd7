// The memory model against measured peaks, the recipe plan, apply_recipe, and the ZeRO
// bytes-per-parameter accounting on the Llama-3.1-8B shape.
#include <gtest/gtest.h>

#include <cmath>

#include "shardtrain/activation/strategy.h"
#include "shardtrain/autograd/engine.h"
#include "shardtrain/core/error.h"
#include "shardtrain/memory/allocator.h"
#include "shardtrain/ops/ops.h"
#include "shardtrain/optim/optimizer.h"
#include "shardtrain/train/bench.h"
#include "shardtrain/train/memory_model.h"
#include "shardtrain/train/plan.h"
#include "shardtrain/train/runtime.h"

using namespace shardtrain;

namespace {

const std::string kConfigs = std::string(SHARDTRAIN_SOURCE_DIR) + "/configs/";
constexpr int64_t kGiB = int64_t{1} << 30;

void expect_within(int64_t predicted, int64_t measured, double tolerance, const std::string& what) {
  double rel = std::abs(static_cast<double>(predicted - measured)) / static_cast<double>(measured);
  EXPECT_LE(rel, tolerance) << what << ": predicted " << predicted << " bytes, measured "
                            << measured;
}

// A step exactly as Runtime::train_step runs it, on a model built here with the strategy applied
// (so that the memory model is checked for every strategy whether or not Runtime offers it yet).
// Returns the device peak of the second step (optimizer state exists from the start).
int64_t measure_hand_built(const train::Config& config) {
  Device cpu = Device::cpu();
  nn::LlamaModel model(train::llama_config_from(config.model), cpu);
  model.init_weights(static_cast<uint64_t>(config.train.seed));
  model.set_attention_impl(ops::parse_attention_impl(config.activation.attention));
  model.set_loss_chunk_rows(config.activation.loss_chunk_tokens);
  activation::ActivationOptions options;
  options.strategy = config.activation.strategy;
  activation::apply_activation_strategy(model, options);
  std::vector<optim::NamedParam> params;
  for (auto& [name, slot] : model.named_parameters()) params.push_back({name, slot});
  optim::AdamW adamw(params, {});
  train::StepBatches batches(config);
  int64_t peak = 0;
  for (int step = 0; step < 2; ++step) {
    std::vector<Batch> micro = batches.next();
    allocator_for(cpu).reset_peak();
    adamw.zero_grad();
    int64_t tokens = 0;
    for (const Batch& mb : micro) tokens += mb.num_target_tokens;
    for (const Batch& mb : micro) {
      Tensor ids = mb.input_ids.to(cpu, MemoryCategory::Activations);
      Tensor targets = mb.targets.to(cpu, MemoryCategory::Activations);
      Tensor loss = model.loss_sum(ids, targets);
      autograd::backward(ops::scale(loss, 1.0f / static_cast<float>(tokens)));
    }
    const double norm = std::sqrt(optim::grad_sum_squares(params));
    adamw.step(1e-3f, optim::clip_factor(norm, 1.0));
    peak = allocator_for(cpu).stats().total_peak;
  }
  return peak;
}

train::Config small_config(const std::vector<std::string>& overrides) {
  std::vector<std::string> all = {"model.vocab_size=256",        "model.hidden_size=64",
                                  "model.intermediate_size=176", "model.num_layers=3",
                                  "model.num_heads=4",           "model.num_kv_heads=2",
                                  "model.max_seq_len=64",        "train.seq_len=64",
                                  "train.micro_batch=2",         "train.device=cpu"};
  all.insert(all.end(), overrides.begin(), overrides.end());
  return train::Config::parse("{}", all, "small");
}

}  // namespace

// ---- predictions against measurements -----------------------------------------------------------

TEST(MemoryModel, EveryStrategyWithinTenPercentOfAMeasuredStep) {
  for (const char* attention : {"plain", "fused"}) {
    for (const std::string& strategy : activation::activation_strategies()) {
      SCOPED_TRACE(strategy + " / " + attention);
      train::Config c = small_config(
          {"activation.strategy=" + strategy, std::string("activation.attention=") + attention});
      int64_t measured = measure_hand_built(c);
      train::MemoryPrediction p = train::predict_memory(train::MemoryModelInput::from_config(c, 1));
      expect_within(p.peak, measured, 0.10, strategy + " / " + attention);
    }
  }
}

TEST(MemoryModel, ChunkedLossWithinTenPercentOfAMeasuredStep) {
  // A vocabulary large beside the hidden size, so the logits are a large part of the peak.
  for (std::string strategy : {"none", "per_layer", "offload_checkpoint"}) {
    SCOPED_TRACE(strategy);
    std::vector<std::string> common = {"activation.strategy=" + strategy,
                                       "activation.attention=fused", "model.vocab_size=2000"};
    train::Config whole = small_config(common);
    common.push_back("activation.loss_chunk_tokens=48");  // 128 rows: 48, 48, 32
    train::Config chunked = small_config(common);
    const int64_t measured = measure_hand_built(chunked);
    const train::MemoryPrediction p =
        train::predict_memory(train::MemoryModelInput::from_config(chunked, 1));
    expect_within(p.peak, measured, 0.10, strategy + " chunked");
    // 128 x 2000 fp32 logits (1 MiB) and their gradient are gone and a 48-row chunk remains;
    // where the logits were the peak (no checkpointing), most of that is saved.
    const int64_t whole_measured = measure_hand_built(whole);
    EXPECT_LT(measured, whole_measured);
    if (strategy == "none") {
      EXPECT_LT(measured, whole_measured - (1 << 20));
    }
  }
}

TEST(MemoryModel, GradientAccumulationKeepsGradientsThroughLaterForwards) {
  train::Config c = small_config({"train.global_batch=4"});  // two micro-batches of 2
  train::MemoryModelInput in = train::MemoryModelInput::from_config(c, 1);
  EXPECT_EQ(in.micro_batches_per_step, 2);
  expect_within(train::predict_memory(in).peak, measure_hand_built(c), 0.10, "accumulation");
}

TEST(Plan, TinyConfigRowsMatchTheRuntime) {
  // configs/tiny.yaml's model with a shorter batch (the rows run on the CPU in a few seconds).
  train::Config c = train::load_config(
      kConfigs + "tiny.yaml", {"train.device=cpu", "train.seq_len=32", "train.micro_batch=2"});
  train::Plan plan = train::make_plan(c, 80 * kGiB, 1);
  ASSERT_EQ(plan.rows.size(), 7u);
  EXPECT_EQ(plan.first_fit, 0);
  train::measure_plan(plan, 0, 1);
  ASSERT_TRUE(plan.rows[0].measured) << plan.rows[0].measure_note;
  for (const train::RecipeRow& r : plan.rows) {
    // Every row runs on one process (the world size is 1).
    ASSERT_TRUE(r.measured) << r.name << ": " << r.measure_note;
    // fp32 rows, and 16-bit rows that ran as the row says. (The CPU backend's 16-bit kernels
    // also use fp32 scratch copies of their inputs, which the model does not count; they are
    // small beside the rest here.)
    if (r.config.precision.compute == "fp32" || r.measure_note.empty())
      expect_within(r.predicted.peak, r.measured_peak, 0.10, r.name);
  }
  std::string table = plan.table();
  EXPECT_NE(table.find("| measured | error |"), std::string::npos) << table;
}

TEST(Plan, Llama125mShapeWithAShortSequenceMatchesTheRuntime) {
  // The 125M shape (vocab 32000, hidden 768, 12 heads) with 2 of its 12 layers: 74 M parameters,
  // so weights, gradients and AdamW state dominate, as on a real GPU run with short sequences.
  train::Config c =
      train::load_config(kConfigs + "llama-125m.yaml",
                         {"train.device=cpu", "train.seq_len=64", "train.micro_batch=1",
                          "model.num_layers=2", "data.path=builtin", "model.vocab_size=32000"});
  train::Plan plan = train::make_plan(c, 80 * kGiB, 1);
  const train::RecipeRow& fp32 = plan.rows[0];
  ASSERT_EQ(fp32.config.precision.compute, "fp32");
  train::BenchRow m = train::measure_config(fp32.config, 0, 1);
  ASSERT_TRUE(m.ok()) << m.message;
  expect_within(fp32.predicted.peak, m.peak_bytes, 0.10, "llama-125m shape, fp32 eager");
  // Weights 4 + AdamW 8 + gradients 4 bytes per parameter are nearly all of it.
  EXPECT_NEAR(static_cast<double>(fp32.predicted.model_state_bytes()),
              16.0 * static_cast<double>(fp32.predicted.trainable_parameters),
              1e-4 * 16.0 * static_cast<double>(fp32.predicted.trainable_parameters));
}

// SGD keeps one fp32 state tensor per parameter with momentum, none without (AdamW two): the
// prediction counts that, and matches a measured step of each.
TEST(MemoryModel, SgdStateMatchesAMeasuredStep) {
  for (const std::string momentum : {"0.9", "0"}) {
    SCOPED_TRACE("momentum " + momentum);
    const train::Config c = small_config({"optim.name=sgd", "optim.momentum=" + momentum});
    const train::MemoryPrediction p =
        train::predict_memory(train::MemoryModelInput::from_config(c, 1));
    EXPECT_EQ(p.optimizer_bytes, momentum == "0" ? 0 : p.master_bytes);
    const train::BenchRow measured = train::measure_config(c, 1, 1);
    ASSERT_EQ(measured.status, train::BenchStatus::Ok) << measured.message;
    expect_within(p.peak, measured.peak_bytes, 0.03, "sgd, momentum " + momentum);
  }
  const train::MemoryPrediction adamw =
      train::predict_memory(train::MemoryModelInput::from_config(small_config({}), 1));
  EXPECT_EQ(adamw.optimizer_bytes, 2 * adamw.master_bytes);
}

TEST(Plan, QloraTinyRowsMatchTheRuntime) {
  // NF4 bases, rank-8 adapters with dropout (each adapter keeps its own input and mask).
  train::Config c =
      train::load_config(kConfigs + "qlora-tiny.yaml", {"train.device=cpu", "train.micro_batch=4"});
  train::Plan plan = train::make_plan(c, 80 * kGiB, 1);
  EXPECT_LT(plan.rows[0].predicted.trainable_parameters,
            plan.rows[0].predicted.total_parameters / 10);
  train::measure_plan(plan, 0, 1);
  ASSERT_TRUE(plan.rows[0].measured) << plan.rows[0].measure_note;
  int measured = 0;
  for (const train::RecipeRow& r : plan.rows) {
    if (!r.measured) continue;
    ++measured;
    expect_within(r.predicted.peak, r.measured_peak, 0.10, "qlora-tiny " + r.name);
  }
  EXPECT_GE(measured, 4) << plan.table();
}

// NF4 quantizes every projection, targeted or not, and an NF4 base saves no input: with some
// projections targeted, only the adapters (and, with dropout, their own dropped-out inputs) keep
// anything of a group's input. Targets that start with the layer's first projections (the
// layers' ops all record); a first target later in the layer over-predicts by part of a layer.
TEST(MemoryModel, QloraWithSomeProjectionsTargetedMatchesAMeasuredStep) {
  for (const std::string targets : {"[q_proj, v_proj]", "[k_proj, gate_proj]"}) {
    for (const std::string dropout : {"0", "0.05"}) {
      const train::Config c =
          train::load_config(kConfigs + "qlora-tiny.yaml",
                             {"train.device=cpu", "train.micro_batch=4",
                              "lora.target_modules=" + targets, "lora.dropout=" + dropout});
      const train::MemoryPrediction predicted =
          train::predict_memory(train::MemoryModelInput::from_config(c, 1));
      const train::BenchRow measured = train::measure_config(c, 1, 1);
      ASSERT_EQ(measured.status, train::BenchStatus::Ok) << measured.message;
      expect_within(predicted.peak, measured.peak_bytes, 0.03,
                    "targets " + targets + ", dropout " + dropout);
    }
  }
}

// ---- ZeRO accounting on the 8B shape --------------------------------------------------------

TEST(Plan, Llama8bModelStatesFollowZeroBytesPerParameter) {
  train::Config c = train::load_config(kConfigs + "llama-3.1-8b.yaml");
  // ZeRO's mixed-precision AdamW: 2 (16-bit weights) + 2 (16-bit gradients) + 12 (fp32 master,
  // momentum, variance) = 16 bytes per parameter. Here the weights and gradients kept between
  // steps are fp32 (4 + 4) and the moments 8: the same 16, split differently; the 16-bit
  // weights exist only as gathered or cast copies.
  auto predict = [&](int world, const std::string& sharding, const std::string& offload) {
    train::Config x = c;
    x.dist.sharding = sharding;
    x.optim.offload = offload;
    return train::predict_memory(train::MemoryModelInput::from_config(x, world));
  };
  train::MemoryPrediction one = predict(1, "full_shard", "none");
  const double P = static_cast<double>(one.trainable_parameters);
  EXPECT_NEAR(P, 8.03e9, 0.005e9);
  EXPECT_EQ(one.total_parameters, one.trainable_parameters);
  EXPECT_NEAR(static_cast<double>(one.model_state_bytes()), 16.0 * P, 1e-6 * 16.0 * P);

  // ZeRO-3 (full_shard over 8): everything divided by 8 (up to the padding of each unit).
  train::MemoryPrediction full8 = predict(8, "full_shard", "none");
  EXPECT_NEAR(static_cast<double>(full8.model_state_bytes()), 16.0 * P / 8, 1e-6 * 16.0 * P);
  EXPECT_NEAR(static_cast<double>(full8.optimizer_bytes), 8.0 * P / 8, 1e-6 * 8.0 * P);
  // ZeRO-2 (grad_op_shard over 8): states sharded, but every unit's 16-bit weights stay gathered
  // from forward to backward: 2 + 14 / 8 bytes per parameter at the peak.
  train::MemoryPrediction op8 = predict(8, "grad_op_shard", "none");
  EXPECT_NEAR(static_cast<double>(op8.model_state_bytes()), 14.0 * P / 8 + 2.0 * P / 8, 1e-5 * P);
  EXPECT_NEAR(static_cast<double>(op8.compute_copy_bytes), 2.0 * P, 1e-4 * 2.0 * P);
  // Plain data parallelism (no_shard): every rank holds all 16.
  train::MemoryPrediction dp8 = predict(8, "no_shard", "none");
  EXPECT_EQ(dp8.model_state_bytes(), one.model_state_bytes());
  // Optimizer offload (ZeRO-Offload): the moments move to the host beside an fp32 master copy
  // (12 bytes per parameter there); the device keeps 4 + 4.
  train::MemoryPrediction off1 = predict(1, "full_shard", "cpu");
  EXPECT_EQ(off1.optimizer_bytes, 0);
  EXPECT_EQ(off1.host_optimizer_bytes, one.optimizer_bytes + one.master_bytes);
  EXPECT_NEAR(static_cast<double>(off1.model_state_bytes()), 8.0 * P, 1e-6 * 8.0 * P);
}

// Shapes whose byte counts would wrap around int64 are refused, not planned as a negative or
// small peak that "fits"; the largest real shapes plan as before.
TEST(MemoryModel, ShapesPastWhatInt64CountsAreRefused) {
  // Each size at the most its config key accepts; together 3 x 2^58 weights.
  train::Config huge = train::load_config(
      kConfigs + "tiny.yaml",
      {"model.hidden_size=1048576", "model.num_layers=65536", "model.intermediate_size=4194304",
       "model.num_heads=1", "model.num_kv_heads=1"});
  const auto input = train::MemoryModelInput::from_config(huge, 1);
  try {
    train::predict_memory(input);
    ADD_FAILURE() << "planned a model of 3 x 2^58 weights";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("the model and batch are too large to plan: with "
                                         "model.hidden_size 1048576"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(train::predict_step_cost(input), ConfigError);
  // A long sequence alone: 2^24 tokens of the 8B model.
  train::Config long_context = train::load_config(
      kConfigs + "llama-3.1-8b.yaml", {"train.seq_len=16777216", "model.max_seq_len=16777216",
                                       "train.micro_batch=32", "train.global_batch=0"});
  EXPECT_THROW(train::predict_memory(train::MemoryModelInput::from_config(long_context, 1)),
               ConfigError);
  // The shipped 8B config at its own shape plans.
  EXPECT_GT(train::predict_memory(train::MemoryModelInput::from_config(
                                      train::load_config(kConfigs + "llama-3.1-8b.yaml"), 1))
                .peak,
            int64_t{0});
}

TEST(Plan, Llama8bOn80GiBNeedsOffloadOnOneGpuAndFullShardOnEight) {
  train::Config c = train::load_config(kConfigs + "llama-3.1-8b.yaml");
  train::Plan one = train::make_plan(c, 80 * kGiB, 1);
  // 16 bytes x 8.03 B parameters = 120 GiB of model states: only optimizer offload fits.
  ASSERT_EQ(one.first_fit, 6) << one.table();
  EXPECT_EQ(one.rows[6].config.optim.offload, "cpu");
  for (int i = 0; i < 6; ++i) EXPECT_GT(one.rows[i].predicted.peak, 80 * kGiB) << i;
  train::Plan eight = train::make_plan(c, 80 * kGiB, 8);
  ASSERT_EQ(eight.first_fit, 5) << eight.table();
  const train::RecipeRow& r = eight.rows[5];
  EXPECT_EQ(r.config.dist.sharding, "full_shard");
  EXPECT_EQ(r.config.activation.strategy, "offload_checkpoint");
  EXPECT_EQ(r.config.precision.compute, "bf16");
  // Recomputing every layer once and the chunked loss's logits: the whole forward again, a
  // third of the step's FLOPs.
  EXPECT_EQ(r.config.activation.loss_chunk_tokens, 128);  // 2048 x 4096 / 128256 -> 66 -> 128
  EXPECT_NEAR(r.cost.recompute_fraction(), 1.0 / 3.0, 1e-9);
  // full_shard: two all-gathers of the layers (bf16), one of the root, one reduce-scatter
  // (fp32), each 7/8 of the model, per micro-batch.
  const double P = static_cast<double>(r.predicted.trainable_parameters);
  EXPECT_GT(static_cast<double>(r.cost.link_bytes), 8 * (7.0 / 8) * P * (2 + 4));
  EXPECT_LT(static_cast<double>(r.cost.link_bytes), 8 * (7.0 / 8) * P * (2 * 2 + 4));
  EXPECT_NE(eight.verdict().find("#6 full_shard over 8 ranks"), std::string::npos)
      << eight.verdict();
}

// ---- apply_recipe -----------------------------------------------------------------------------

TEST(Recipe, ApplyRecipeReturnsTheFirstRowThatFits) {
  train::Config c = train::load_config(kConfigs + "tiny.yaml", {"recipe=auto"});
  train::Plan plan = train::make_plan(c, 80 * kGiB, 1);
  std::string why;
  train::Config roomy = train::apply_recipe(c, 80 * kGiB, 1, &why);
  EXPECT_EQ(roomy.precision.compute, "fp32");
  EXPECT_EQ(roomy.activation.strategy, "none");
  EXPECT_EQ(roomy.recipe, "manual");
  EXPECT_EQ(roomy.model, c.model);
  EXPECT_EQ(roomy.train, c.train);
  EXPECT_NE(why.find("#1 fp32 eager"), std::string::npos) << why;

  // A device just big enough for per_layer checkpointing (row 4) but not the fused kernels row.
  ASSERT_GT(plan.rows[2].predicted.peak, plan.rows[3].predicted.peak);
  int64_t device = plan.rows[3].predicted.peak;
  train::Config tight = train::apply_recipe(c, device, 1, &why);
  EXPECT_EQ(tight.precision.compute, "bf16");
  EXPECT_EQ(tight.precision.param_dtype, "");
  EXPECT_EQ(tight.activation.attention, "fused");
  EXPECT_EQ(tight.activation.strategy, "per_layer");
  EXPECT_EQ(tight.optim.offload, "none");
  EXPECT_NE(why.find("per_layer"), std::string::npos) << why;

  try {
    train::apply_recipe(c, 1 << 20, 1);
    ADD_FAILURE() << "1 MiB cannot hold the tiny model";
  } catch (const ConfigError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("nothing fits"), std::string::npos) << m;
    EXPECT_NE(m.find("| # | recipe step |"), std::string::npos) << m;
  }
  EXPECT_THROW(train::make_plan(c, 0, 1), ConfigError);
  EXPECT_THROW(train::make_plan(c, kGiB, 0), ConfigError);
}
