// A sharded training job in which the last rank throws in the middle of its second step, while
// the other ranks go on into collectives it will never join. Its top-level handler must end the
// whole job (dist::abort_job) with that rank's message. Run by tests/mpi/launcher/rank_failure.cpp.
#include <cstdio>

#include "shardtrain/dist/env.h"
#include "shardtrain/fsdp/fsdp.h"
#include "tiny_llama.h"

using namespace shardtrain;

int main() {
  try {
    dist::DistOptions options;
    options.timeout_s = 120;  // far beyond the launcher's limit: only abort_job ends this job
    dist::DistEnv env(options);
    nn::LlamaConfig cfg = test::tiny_config(2);
    nn::LlamaModel model(cfg, Device::cpu());
    model.init_weights(1);
    fsdp::ShardedModel sharded(model, env, {});
    int step = 0;
    const int failing_rank = env.world_size() - 1;
    // Innermost wrapper: runs inside layer 1's forward, with its parameters gathered and the
    // next unit's gather in flight.
    model.add_layer_wrapper([&](int layer, const nn::TensorFn& inner, const Tensor& x) {
      if (step == 1 && layer == 1 && env.rank() == failing_rank)
        throw Error("simulated failure in step 1 (layer 1 forward)");
      return inner(x);
    });
    optim::AdamW opt(sharded.optimizer_params(), {});
    std::vector<test::MicroBatch> batches =
        test::make_micro_batches(env.world_size(), 2, 8, cfg.vocab_size, 3);
    for (step = 0; step < 4; ++step) {
      test::forward_backward(model, {batches[static_cast<size_t>(env.rank())]},
                             test::total_tokens(batches));
      opt.step(1e-3f);
      opt.zero_grad();
      std::printf("rank %d finished step %d\n", env.rank(), step);
      std::fflush(stdout);
    }
    return 0;
  } catch (const std::exception& e) {
    if (dist::job_world_size() > 1) dist::abort_job(e.what());
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
