// A Llama small enough for unit tests whose sizes split unevenly over 3, 4, 5, 7 or 8 ranks
// (vocabulary 37, hidden 12, MLP 23: 1284 elements per layer, 900 in the root when untied), so
// that parameters straddle shard boundaries and the sharded units need padding.
#pragma once
#include "shardtrain/nn/llama.h"

namespace shardtrain::testing {

inline nn::LlamaConfig uneven_llama_config(int layers, bool tied) {
  nn::LlamaConfig c;
  c.vocab_size = 37;
  c.hidden_size = 12;
  c.intermediate_size = 23;
  c.num_layers = layers;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.max_seq_len = 8;
  c.init_std = 0.3f;
  c.tie_embeddings = tied;
  return c;
}

}  // namespace shardtrain::testing
