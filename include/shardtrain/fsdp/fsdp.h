// Fully sharded data parallelism (PyTorch FSDP semantics) for a LlamaModel.
//
// Units: every decoder layer is one unit; the embeddings, the final norm and the head form the
// root unit. Each unit's parameters, sorted by name, are concatenated into a flat parameter,
// padded to a multiple of the shard group size S. Each rank keeps only its 1/S shard of the
// flat parameter, in fp32 (the master weights), and the model's parameter slots are emptied.
//
// Building without a full copy (PyTorch's meta device + param_init_fn): a model built with
// nn::ParameterStorage::Deferred has parameter shapes but no storage, and the shards are then
// created directly, only this rank's elements ever existing: from a ParamRangeInit (seeded_init
// gives exactly the values LlamaModel::init_weights would, element for element), or left zero
// for load_full_parameters to fill one full parameter at a time (io::load_hf_weights for
// sharded models reads only this rank's elements from the mapped files). Peak parameter memory
// at start-up is then the shards alone. A model with allocated parameters is copied from
// instead, and its full parameters released (every rank must then hold the same weights).
//
// Forward of a unit: all-gather the flat parameter in the compute dtype (param_dtype), put views
// of it into the parameter slots, run the unit, restore the slots. The views come from one
// autograd node per unit, so the gradients of all of them arrive together; its backward
// concatenates them into one flat gradient, reduce-scatters it (in reduce_dtype, summed) and adds
// this rank's part to the .grad of the shard pieces. Strategies:
//   full_shard     gathered parameters are freed after each layer's forward and gathered again
//                  before its backward (the root unit stays gathered from its forward to its
//                  backward, since the head's backward comes first)
//   grad_op_shard  gathered parameters stay until the unit's backward (no second gather)
//   no_shard       plain data parallelism: full fp32 replicas, gradients all-reduced
//   hybrid_shard   full_shard within a node, shard gradients all-reduced across nodes
// With prefetch, the next unit's all-gather is issued before the current unit computes (forward
// order in forward, reverse order in backward). Gathered buffers are freed by dropping their bytes
// (the views stay valid and are refilled by the next gather, as PyTorch's storage resize_(0)).
//
// Gradients are SUMMED over ranks, never averaged: the training step divides each rank's summed
// loss by the global number of counted target tokens, so the sum is the global batch's gradient.
//
// The optimizer gets one entry per (parameter, rank) piece: the part of the named parameter
// that lies in this rank's shard, a 1-d fp32 view into the shard (see optimizer_params()).
// Optimizer state is therefore sharded too, and per-parameter rules (weight decay by name) work
// as in single-process training. Padding belongs to no piece and stays zero.
//
// Activation checkpointing composes in either wrapper order: a unit's forward that runs again
// during backward (a recompute) uses the parameters gathered for the backward and neither frees
// them nor gathers them twice.
//
// Every method that communicates is collective: all ranks must call it, in the same order.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "shardtrain/dist/env.h"
#include "shardtrain/fsdp/flat_param.h"
#include "shardtrain/nn/llama.h"
#include "shardtrain/optim/optimizer.h"

namespace shardtrain::fsdp {

enum class ShardingStrategy { FullShard, GradOpShard, NoShard, HybridShard };
// "full_shard" | "grad_op_shard" | "no_shard" | "hybrid_shard"; throws ConfigError naming
// dist.sharding otherwise.
ShardingStrategy parse_sharding_strategy(const std::string& name);
std::string_view sharding_strategy_name(ShardingStrategy s);

struct FsdpOptions {
  ShardingStrategy strategy = ShardingStrategy::FullShard;
  DType param_dtype = DType::F32;   // dtype of the gathered parameters (the compute dtype)
  DType reduce_dtype = DType::F32;  // dtype gradients are reduced in
  bool prefetch = true;
  // false: accumulate unsharded gradients locally over micro-batches and reduce them once, after
  // the last one (see set_microbatch): less traffic, one full gradient copy more memory.
  bool sync_every_microbatch = true;
};

// Fills out[0, length) (host memory) with elements [begin, begin + length) of the flattened
// parameter `name`: how the shards of deferred parameters get their values.
using ParamRangeInit =
    std::function<void(const std::string& name, int64_t begin, int64_t length, float* out)>;

// The values model.init_weights(seed) gives (nn::LlamaModel::init_parameter_range). `model` must
// outlive the returned function.
ParamRangeInit seeded_init(const nn::LlamaModel& model, uint64_t seed);

// The part of a full parameter that one optimizer entry covers.
struct ParamPiece {
  std::string name;    // the parameter's Hugging Face name (also the optimizer entry's name)
  Shape full_shape;    // the whole parameter's shape
  int64_t begin = 0;   // first element covered, in the flattened parameter
  int64_t length = 0;  // elements covered
};

class ShardedModel {
 public:
  // Shards `model` over `env`'s groups (chosen by options.strategy). Deferred parameters get
  // their shard elements from `init`; without one they stay zero until load_full_parameters, and
  // a forward or for_each_full_parameter before that throws. Allocated parameters are copied
  // (every rank must then hold the same weights: the same init seed, or the same loaded file)
  // and released. Throws ConfigError for parameters that are not trainable fp32 tensors, or for
  // hybrid sharding over nodes of different sizes. `model` and the groups must outlive this
  // object, and this object must outlive every forward and backward of `model`.
  ShardedModel(nn::LlamaModel& model, dist::DistEnv& env, FsdpOptions options,
               const ParamRangeInit& init = {});
  // The same over explicit groups (PyTorch FSDP's process_group): `shard_group` splits every
  // flat parameter; `replicate_group`, when not null, holds replicas of this rank's shards whose
  // gradients are all-reduced (hybrid_shard's inter-node group, no_shard's world). The groups
  // decide who holds what; options.strategy then only decides when gathered parameters are freed.
  ShardedModel(nn::LlamaModel& model, dist::ProcessGroup& shard_group,
               dist::ProcessGroup* replicate_group, FsdpOptions options,
               const ParamRangeInit& init = {});
  ~ShardedModel();
  ShardedModel(const ShardedModel&) = delete;
  ShardedModel& operator=(const ShardedModel&) = delete;

  // ---- training step ----------------------------------------------------------------------
  // This rank's fp32 master pieces, for the optimizer (stable pointers, one per parameter that
  // has elements in this rank's shard; names repeat across ranks).
  std::vector<optim::NamedParam> optimizer_params();
  std::vector<ParamPiece> param_pieces() const;

  // Tells which micro-batch (0-based, of `count`) the next forward/backward is. Only matters
  // when sync_every_microbatch is off: gradients are then reduced in the last one's backward.
  void set_microbatch(int index, int count);
  // Whether the current micro-batch's backward reduces gradients across ranks.
  bool syncs_gradients_now() const;

  // Waits for every gradient reduction still in flight. Backward calls it itself when the last
  // unit's gradient has been issued; calling it again is harmless.
  void wait_for_gradients();

  // Global sum of squared gradient elements over the whole model (every rank gets the same
  // value). Its square root is the global norm for optim::clip_factor.
  double grad_sum_squares();
  // True on every rank when `flag` is true on any rank of the shard and replicate groups
  // (found-inf of loss scaling).
  bool any_rank(bool flag);

  // ---- full state (export, checkpoints, tests) --------------------------------------------
  using FullTensorFn = std::function<void(const std::string& name, const Tensor& full)>;
  // Gathers the full fp32 parameters one unit at a time (root first, then the layers) and calls
  // `fn` for each parameter with a tensor on the training device, valid during the call.
  void for_each_full_parameter(const FullTensorFn& fn);
  // The same for the (accumulated, reduced) gradients; zeros where a piece has no gradient.
  void for_each_full_gradient(const FullTensorFn& fn);
  // Copies this rank's parts of full weights into the shards: `get(name)` returns the full
  // parameter (any float dtype, any device; a zero-copy view of a mapped file is best). It is
  // called once for each parameter that has elements in this rank's shards, one at a time, and
  // the returned tensor is released before the next call. No communication. Throws ShapeError
  // when a returned tensor's element count does not match.
  void load_full_parameters(const std::function<Tensor(const std::string& name)>& get);

  // ---- introspection -----------------------------------------------------------------------
  nn::LlamaModel& model() { return model_; }
  const FsdpOptions& options() const { return options_; }
  int num_units() const { return static_cast<int>(units_.size()); }
  // Unit i < num_layers is decoder layer i; the last unit is the root.
  const std::string& unit_name(int unit) const;
  const FlatParamLayout& unit_layout(int unit) const;
  dist::ProcessGroup& shard_group() { return *shard_group_; }
  dist::ProcessGroup* replicate_group() { return replicate_group_; }
  // Number of units whose gathered parameters are allocated right now.
  int num_gathered_units() const;

  // Collectives issued over groups of more than one rank since construction (or reset).
  struct CommStats {
    int64_t all_gathers = 0, gathered_bytes = 0;              // parameter gathers (received bytes)
    int64_t reduce_scatters = 0, reduce_scattered_bytes = 0;  // gradient reduce-scatters (sent)
    int64_t all_reduces = 0, all_reduced_bytes = 0;  // gradient all-reduces across replicas
  };
  const CommStats& comm_stats() const { return comm_stats_; }
  void reset_comm_stats() { comm_stats_ = {}; }

  struct Unit;  // defined in the implementation

 private:
  friend struct UnitParamsNode;
  struct Groups {
    dist::ProcessGroup* shard = nullptr;
    dist::ProcessGroup* replicate = nullptr;
  };
  static Groups groups_for(dist::DistEnv& env, ShardingStrategy strategy);
  ShardedModel(nn::LlamaModel& model, Groups groups, FsdpOptions options,
               const ParamRangeInit& init);
  void check_has_values() const;
  Tensor run_unit(Unit& unit, const nn::TensorFn& inner, const Tensor& x, Unit* next);
  void begin_forward();
  void start_gather(Unit& unit);
  void ensure_gathered(Unit& unit);
  void free_gathered(Unit& unit);
  std::vector<Tensor> make_views(Unit& unit, bool with_graph);
  void install(Unit& unit, const std::vector<Tensor>& views);
  void uninstall(Unit& unit);
  void pre_backward(Unit& unit);
  void post_backward(Unit& unit, std::vector<Tensor>& grads);
  void launch_reduce(Unit& unit, Tensor flat_grad);
  void complete_oldest_reduce();
  void finish_backward();
  Unit* previous_in_backward(Unit& unit);
  Tensor gathered_flat(Unit& unit) const;
  Tensor flatten_grads(Unit& unit, const std::vector<Tensor>& grads, DType dtype) const;
  Tensor full_flat(Unit& unit, bool gradients);

  nn::LlamaModel& model_;
  FsdpOptions options_;
  Device device_;
  dist::ProcessGroup* shard_group_ = nullptr;
  dist::ProcessGroup* replicate_group_ = nullptr;
  std::vector<std::unique_ptr<Unit>> units_;  // layers, then the root
  struct PendingReduce;
  std::vector<std::unique_ptr<PendingReduce>> reduces_;
  int awaiting_backward_ = 0;  // units whose backward has not run yet
  bool in_backward_ = false;
  int microbatch_ = 0, microbatches_ = 1;
  CommStats comm_stats_;
  bool awaiting_values_ = false;  // deferred parameters, no initializer, nothing loaded yet
  std::shared_ptr<bool> alive_;   // the model's wrappers check it
};

}  // namespace shardtrain::fsdp
