// `shardtrain check` against references that are incomplete, mis-shaped or out of range: each is
// an error naming the file and what is wrong, never a PASS on whatever tensors are left. And a
// reference that is complete but wrong in one gradient fails the comparison (the check can fail).
#include <gtest/gtest.h>

#include "expect_error.h"
#include "temp_dir.h"

#include <cmath>
#include <map>
#include <string>

#include "shardtrain/core/error.h"
#include "shardtrain/io/safetensors.h"
#include "shardtrain/tensor/tensor.h"
#include "shardtrain/train/check.h"
#include "shardtrain/train/config.h"

namespace shardtrain {
namespace {

using shardtrain::testing::expect_error;

const std::string kGolden = std::string(SHARDTRAIN_TEST_DATA) + "/golden/llama-tiny-gqa";

struct Reference {
  NamedTensors tensors;
  std::map<std::string, std::string> metadata;

  static Reference golden() {
    SafetensorsFile f = SafetensorsFile::open(kGolden + "/expected.safetensors");
    Reference r;
    for (const std::string& name : f.names()) r.tensors.emplace_back(name, f.load(name));
    r.metadata = f.metadata();
    return r;
  }
  void drop(const std::string& name) {
    std::erase_if(tensors, [&](const auto& t) { return t.first == name; });
  }
  Tensor& at(const std::string& name) {
    for (auto& [n, t] : tensors)
      if (n == name) return t;
    throw std::out_of_range(name);
  }
};

class Check : public ::testing::Test {
 protected:
  train::CheckReport run(const Reference& reference, const std::string& batch = "",
                         std::vector<std::string> sets = {}) {
    const std::string expected = tmp_ / "expected.safetensors";
    save_safetensors(expected, reference.tensors, reference.metadata);
    train::CheckOptions o;
    o.model_dir = kGolden;
    o.batch_file = batch.empty() ? kGolden + "/batch.safetensors" : batch;
    o.expected_file = expected;
    sets.push_back("train.device=cpu");
    return train::run_check(train::Config::parse("{}", sets, "test"), o);
  }
  std::string expected_path() const { return tmp_ / "expected.safetensors"; }

  shardtrain::testing::TempDir tmp_{"check"};
};

TEST_F(Check, TheGoldenReferencePassesAndOneWrongGradientFails) {
  train::CheckReport report = run(Reference::golden());
  EXPECT_TRUE(report.ok()) << report.table();
  EXPECT_EQ(report.tensors.size(), 44u);

  Reference r = Reference::golden();
  Tensor& g = r.at("grad.model.layers.1.mlp.up_proj.weight");
  std::vector<float> values = g.to_float_vector();
  values[3] = values[3] * 1.05f + 1e-3f;  // 5 % and more off, far beyond fp32's 1e-4
  g = from_floats(values, g.shape());
  report = run(r);
  EXPECT_FALSE(report.ok());
  int failed = 0;
  for (const train::TensorError& t : report.tensors)
    if (!t.ok) {
      ++failed;
      EXPECT_EQ(t.name, "grad.model.layers.1.mlp.up_proj.weight");
    }
  EXPECT_EQ(failed, 1) << report.table();
}

TEST_F(Check, AnIncompleteOrMisnamedReferenceIsAnError) {
  Reference r = Reference::golden();
  r.drop("logits");
  r.drop("grad.model.norm.weight");
  expect_error<FormatError>(
      [&] { run(r); }, {"'" + expected_path() + "' lacks 2 of the 44 reference tensors", "logits",
                        "grad.model.norm.weight"});
  r = Reference::golden();
  r.tensors.emplace_back("grad.model.nrom.weight", r.at("grad.model.norm.weight").clone());
  expect_error<FormatError>([&] { run(r); },
                            {"holds 1 tensor(s) this model has no counterpart for: "
                             "grad.model.nrom.weight (misspelled?"});
}

// An inf in the reference would widen its element's tolerance (and the tensor's default atol,
// from its RMS) to inf and pass anything; a nan compares false. Both are unusable input.
TEST_F(Check, AReferenceThatIsNotFiniteIsAnError) {
  for (const float bad : {INFINITY, -INFINITY, NAN}) {
    for (const std::string name :
         {"loss", "logits", "grad.lm_head.weight", "step1.lm_head.weight"}) {
      Reference r = Reference::golden();
      Tensor& t = r.at(name);
      std::vector<float> values = t.to_float_vector();
      values.back() = bad;
      t = from_floats(values, t.shape());
      expect_error<FormatError>([&] { run(r); },
                                {"'" + expected_path() + "': '" + name + "' holds ",
                                 " at element " + std::to_string(values.size() - 1),
                                 "a reference must hold finite numbers"});
    }
  }
}

TEST_F(Check, ShapesAndHyperParametersMustFitTheReferenceStep) {
  Reference r = Reference::golden();
  Tensor& norm = r.at("grad.model.norm.weight");
  norm = norm.view({2, norm.numel() / 2});
  expect_error<FormatError>([&] { run(r); },
                            {"'grad.model.norm.weight' is", "but this model and batch give ["});

  auto with_metadata = [](const std::string& key, const std::string& value) {
    Reference m = Reference::golden();
    m.metadata[key] = value;
    return m;
  };
  expect_error<FormatError>([&] { run(with_metadata("lr", "0.001xyz")); },
                            {"__metadata__ 'lr' = '0.001xyz' is not a number"});
  expect_error<FormatError>([&] { run(with_metadata("lr", "nan")); }, {"is not a number"});
  expect_error<FormatError>([&] { run(with_metadata("beta1", "1.5")); },
                            {"__metadata__ 'beta1' = 1.5 is out of range: must be in [0, 1)"});
  expect_error<FormatError>([&] { run(with_metadata("optimizer", "sgd")); },
                            {"'optimizer' = 'sgd'", "AdamW"});
  expect_error<ConfigError>([&] { run(Reference::golden(), "", {"lora.enabled=true"}); },
                            {"lora.enabled"});

  // A batch without sequences.
  const std::string empty = tmp_ / "empty.safetensors";
  save_safetensors(
      empty, {{"input_ids", zeros({0, 8}, DType::I64)}, {"targets", zeros({0, 8}, DType::I64)}});
  expect_error<FormatError>([&] { run(Reference::golden(), empty); },
                            {"the batch is empty", "at least one sequence"});

  // Token ids outside the model's vocabulary name the file, the tensor and the position.
  SafetensorsFile golden_batch = SafetensorsFile::open(kGolden + "/batch.safetensors");
  auto batch_with = [&](const std::string& name, const char* tensor, int64_t value) {
    Tensor ids = golden_batch.load("input_ids", Device::cpu(), DType::I64);
    Tensor targets = golden_batch.load("targets", Device::cpu(), DType::I64);
    Tensor& changed = std::string(tensor) == "input_ids" ? ids : targets;
    static_cast<int64_t*>(changed.data_ptr())[1] = value;
    const std::string path = tmp_ / name;
    save_safetensors(path, {{"input_ids", ids}, {"targets", targets}});
    return path;
  };
  const std::string too_large = batch_with("oov.safetensors", "input_ids", 1 << 20);
  expect_error<FormatError>([&] { run(Reference::golden(), too_large); },
                            {"'" + too_large + "': input_ids[0, 1] = 1048576 is not a token id"});
  const std::string negative = batch_with("neg.safetensors", "targets", -1);
  expect_error<FormatError>([&] { run(Reference::golden(), negative); },
                            {"'" + negative + "': targets[0, 1] = -1 is not a token id",
                             "-100 marks a position without a target"});
  // Token ids stored as floats (3.7 would be truncated to 3, NaN undefined) are refused as such.
  {
    Tensor ids = golden_batch.load("input_ids", Device::cpu(), DType::F32);
    Tensor targets = golden_batch.load("targets", Device::cpu(), DType::I64);
    static_cast<float*>(ids.data_ptr())[0] = 3.7f;
    const std::string floats = tmp_ / "float-ids.safetensors";
    save_safetensors(floats, {{"input_ids", ids}, {"targets", targets}});
    expect_error<FormatError>(
        [&] { run(Reference::golden(), floats); },
        {"'" + floats + "': input_ids is stored as f32; token ids must be integers"});
  }
}

}  // namespace
}  // namespace shardtrain
