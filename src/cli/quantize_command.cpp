// `shardtrain quantize`: writes a Hugging Face model's 4-bit NF4 base once, in bitsandbytes'
// layout, so QLoRA runs (lora.base_model) read it as stored instead of quantizing at every start,
// and Transformers loads it as a 4-bit model.
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>

#include "shardtrain/cli/command.h"
#include "shardtrain/core/dtype.h"
#include "shardtrain/core/units.h"
#include "shardtrain/io/bnb.h"
#include "shardtrain/io/hf_model.h"
#include "shardtrain/io/safetensors.h"
#include "shardtrain/nn/llama.h"

namespace shardtrain::cli {

Command quantize_command() {
  Command c;
  c.name = "quantize";
  c.summary = "write a Hugging Face model's NF4 (QLoRA) base in bitsandbytes' 4-bit layout";
  c.description =
      "Quantizes every decoder projection of --model to NF4 with double-quantized block scales\n"
      "(the base a QLoRA run builds at start, bit for bit) and writes it to --output as\n"
      "bitsandbytes saves a 4-bit model: lora.base_model then reads the codes as stored, and\n"
      "Transformers (with bitsandbytes) loads it as a 4-bit model. Embeddings, norms and the\n"
      "head stay dense, in --dtype. The tokenizer and generation files are copied.";
  c.flags = {
      Flag("model", "DIR", "Hugging Face model directory (config.json + safetensors)").mandatory(),
      Flag("output", "DIR", "directory to write (created; its files replaced atomically)")
          .mandatory(),
      Flag("dtype", "bf16|fp16|fp32",
           "dtype of the dense weights (default: the one the source's embeddings are stored in)"),
  };
  c.run = [](const Args& args) {
    namespace fs = std::filesystem;
    const std::string model_dir = args.get("model"), output = args.get("output");
    std::string dtype_flag = args.has("dtype") ? args.get("dtype") : "";
    if (!dtype_flag.empty() && dtype_flag != "bf16" && dtype_flag != "fp16" && dtype_flag != "fp32")
      throw UsageError("--dtype must be bf16, fp16 or fp32, got '" + dtype_flag + "'");
    std::error_code ec;
    if (fs::equivalent(model_dir, output, ec))
      throw UsageError("--output '" + output + "' is --model's directory: write the 4-bit " +
                       "model to another directory");
    const nn::LlamaConfig config =
        nn::LlamaConfig::from_hf_json((fs::path(model_dir) / "config.json").string());
    if (dtype_flag.empty()) {
      // The source's dtype unless told otherwise: the one its embeddings are stored in (what
      // config.json's torch_dtype says is only a label, and may be missing or wrong), so that its
      // embeddings, norms and head are stored as they were. Without them the load below says so.
      const SafetensorsCheckpoint source = SafetensorsCheckpoint::open(model_dir);
      const std::string embed = "model.embed_tokens.weight";
      const DType stored = source.contains(embed) ? source.info(embed).dtype : DType::BF16;
      dtype_flag = stored == DType::F32 ? "fp32" : stored == DType::F16 ? "fp16" : "bf16";
    }
    // Before minutes of quantizing: an output that cannot be written fails now.
    create_output_dir(output);
    const auto start = std::chrono::steady_clock::now();
    nn::LlamaModel model(config, Device::cpu(), nn::ParameterStorage::Deferred);
    // Minutes for billions of weights: a redrawn count on a terminal, a line per tenth in a log.
    const bool terminal = isatty(STDERR_FILENO) != 0;
    io::load_nf4_base_from_hf(model, model_dir, [&](int64_t done, int64_t total) {
      if (!terminal && done != total && done * 10 / total == (done - 1) * 10 / total) return;
      std::fprintf(stderr, "%sNF4 projections: %lld/%lld%s", terminal ? "\r" : "",
                   static_cast<long long>(done), static_cast<long long>(total),
                   terminal && done != total ? "" : "\n");
      std::fflush(stderr);
    });
    io::save_bnb_4bit_model(model, output, dtype_from_name(dtype_flag));
    io::carry_hf_metadata(model_dir, output, /*trained_seq_len=*/0);
    const int64_t bytes = SafetensorsCheckpoint::open(output).tensor_bytes();
    std::cout
        << "wrote " << output << ": " << config.num_parameters() << " weights in "
        << format_bytes(bytes) << " ("
        << fmt::format(
               "{:.1f}",
               std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count())
        << " s); use it as lora.base_model\n";
    return 0;
  };
  return c;
}

}  // namespace shardtrain::cli
