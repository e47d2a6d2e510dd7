// `shardtrain check`: reproduces a reference case under any training configuration.
#include <cstdio>
#include <string>

#include "shardtrain/cli/command.h"
#include "shardtrain/train/check.h"

namespace shardtrain::cli {

// Distinct from the CLI's 1 (an error), so that a script can tell a wrong result from bad input.
constexpr int kToleranceExceeded = 4;

Command check_command() {
  Command c;
  c.name = "check";
  c.summary = "compare loss, logits, gradients and one AdamW step against a reference case";
  c.description =
      "Loads a Hugging Face-layout model, runs forward and backward on --batch and one AdamW\n"
      "step with the hyper-parameters in --expected's metadata, under the configuration given\n"
      "by --config/--set (activation strategy, precision, sharding, micro-batches; the model\n"
      "is --model's, whatever the config's model section says), and prints the error of every\n"
      "tensor: an element passes within atol + rtol x |reference|, and '+' marks an atol\n"
      "widened element by element (the AdamW step's tensors). Exits 0 when every tensor is\n"
      "within tolerance, 4 when any is beyond it, and 1 when the inputs are unusable (a\n"
      "reference missing tensors, shapes that do not fit the model, hyper-parameters out of\n"
      "range).";
  c.flags = {
      Flag("model", "DIR", "model directory (config.json + model.safetensors)").mandatory(),
      Flag("batch", "FILE", "safetensors with input_ids and targets [batch, seq]").mandatory(),
      Flag("expected", "FILE", "safetensors with loss, logits, grad.*, step1.*").mandatory(),
      Flag("rtol", "X", "relative tolerance (default 1e-4 in fp32, 5e-2 in bf16, 1e-2 in fp16)"),
      Flag("atol", "X", "absolute tolerance (default rtol x the reference tensor's RMS)")};
  for (Flag& f : config_flags(/*config_required=*/false)) {
    if (f.name == "config") f.required = false;
    c.flags.push_back(f);
  }
  c.run = [](const Args& args) {
    train::Config config = args.has("config")
                               ? config_from_args(args)
                               : train::Config::parse("{}", args.all("set"), "defaults");
    train::CheckOptions o;
    o.model_dir = args.get("model");
    o.batch_file = args.get("batch");
    o.expected_file = args.get("expected");
    if (args.has("rtol"))
      o.rtol = args.get_number("rtol", false, "a positive relative tolerance such as 1e-4");
    if (args.has("atol"))
      o.atol = args.get_number("atol", true, "an absolute tolerance >= 0 such as 1e-6");
    train::CheckReport report = train::run_check(config, o);
    if (report.leader) std::printf("%s", report.table().c_str());
    return report.ok() ? 0 : kToleranceExceeded;
  };
  return c;
}

}  // namespace shardtrain::cli
