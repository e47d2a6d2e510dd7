// ShardedModel: flat parameters, gathering around each unit's forward, gradient reduction in
// its backward (see include/shardtrain/fsdp/fsdp.h).
#include "shardtrain/fsdp/fsdp.h"

#include <algorithm>
#include <deque>

#include "shardtrain/autograd/grad_mode.h"
#include "shardtrain/autograd/node.h"
#include "shardtrain/backend/backend.h"

namespace shardtrain::fsdp {

ShardingStrategy parse_sharding_strategy(const std::string& name) {
  if (name == "full_shard") return ShardingStrategy::FullShard;
  if (name == "grad_op_shard") return ShardingStrategy::GradOpShard;
  if (name == "no_shard") return ShardingStrategy::NoShard;
  if (name == "hybrid_shard") return ShardingStrategy::HybridShard;
  throw ConfigError("dist.sharding: '" + name +
                    "' is not one of full_shard, grad_op_shard, no_shard, hybrid_shard");
}

std::string_view sharding_strategy_name(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::FullShard:
      return "full_shard";
    case ShardingStrategy::GradOpShard:
      return "grad_op_shard";
    case ShardingStrategy::NoShard:
      return "no_shard";
    case ShardingStrategy::HybridShard:
      return "hybrid_shard";
  }
  return "?";
}

struct ShardedModel::Unit {
  std::string name;  // "model.layers.3" or "root"
  bool is_root = false;
  std::vector<Tensor*> slots;  // in layout order
  FlatParamLayout layout;
  Tensor shard;                // fp32 [shard_numel]: this rank's master weights
  std::vector<Tensor> pieces;  // leaf views of `shard` requiring grad, one per piece
  std::vector<FlatParamLayout::Piece> piece_layout;

  // The gathered flat parameter [padded] in the compute dtype. Its bytes are dropped when the
  // unit is resharded; views of it stay valid and see the bytes of the next gather. With one
  // shard in fp32 it is the shard's own storage (nothing to gather or free).
  std::shared_ptr<Storage> gathered;
  bool zero_copy = false;
  enum class State { Sharded, Gathering, Gathered } state = State::Sharded;
  dist::WorkPtr gather_work;
  Tensor gather_input;  // the compute-dtype copy of the shard an in-flight gather reads

  // This micro-batch's parameter views (outputs of `node`) until the unit's backward has run.
  std::vector<Tensor> views;
  std::weak_ptr<autograd::Node> node;
  bool awaiting_backward = false;

  bool installed = false;
  std::vector<Tensor> saved_slots;

  Tensor grad_accum;  // fp32 [padded]: unreduced gradients (sync_every_microbatch off)
};

struct ShardedModel::PendingReduce {
  Unit* unit = nullptr;
  Tensor flat;  // the unsharded gradient being reduced
  Tensor out;   // this rank's reduced shard of it
  dist::WorkPtr work;
};

// The backward of a unit's parameter views: receives the gradients of all of them at once.
struct UnitParamsNode : autograd::Node {
  ShardedModel* owner = nullptr;
  ShardedModel::Unit* unit = nullptr;
  std::string name() const override { return "FsdpUnitParamsBackward"; }
  std::vector<Tensor> apply(std::vector<Tensor> grads) override {
    owner->post_backward(*unit, grads);
    return {};
  }
};

namespace {
Tensor make_gradient(const Shape& shape, DType dtype, Device device) {
  CategoryScope scope(MemoryCategory::Gradients);
  return zeros(shape, dtype, device);
}

// Writes elements [begin, begin + dst.numel()) of parameter `name`, as `init` gives them, into
// the fp32 tensor `dst` (through a host buffer when `dst` is not CPU-addressable).
void fill_from_init(const ParamRangeInit& init, const std::string& name, int64_t begin,
                    Tensor& dst) {
  if (dst.device().cpu_addressable()) {
    init(name, begin, dst.numel(), dst.data<float>());
    return;
  }
  CategoryScope scope(MemoryCategory::Workspace);
  Tensor staged = empty({dst.numel()}, DType::F32, Device::host());
  init(name, begin, dst.numel(), staged.data<float>());
  dst.copy_from(staged);
}
}  // namespace

// ---- construction -----------------------------------------------------------------------------

ParamRangeInit seeded_init(const nn::LlamaModel& model, uint64_t seed) {
  return [&model, seed](const std::string& name, int64_t begin, int64_t length, float* out) {
    model.init_parameter_range(seed, name, begin, length, out);
  };
}

ShardedModel::Groups ShardedModel::groups_for(dist::DistEnv& env, ShardingStrategy strategy) {
  switch (strategy) {
    case ShardingStrategy::FullShard:
    case ShardingStrategy::GradOpShard:
      return {&env.world(), nullptr};
    case ShardingStrategy::NoShard:
      return {&env.self(), env.world_size() > 1 ? &env.world() : nullptr};
    case ShardingStrategy::HybridShard: {
      std::vector<int64_t> sizes{env.local_size(), -static_cast<int64_t>(env.local_size())};
      env.world().all_reduce_host(sizes, dist::ReduceOp::Max);
      ST_CHECK_AS(ConfigError, sizes[0] == -sizes[1],
                  "dist.sharding=hybrid_shard needs the same "
                  "number of ranks on every node, but nodes have between ",
                  -sizes[1], " and ", sizes[0],
                  " ranks; launch the same number per node or set dist.ranks_per_node");
      return {&env.intra_node(), env.num_nodes() > 1 ? &env.inter_node() : nullptr};
    }
  }
  throw ConfigError("unknown sharding strategy");
}

ShardedModel::ShardedModel(nn::LlamaModel& model, dist::DistEnv& env, FsdpOptions options,
                           const ParamRangeInit& init)
    : ShardedModel(model, groups_for(env, options.strategy), options, init) {}

ShardedModel::ShardedModel(nn::LlamaModel& model, dist::ProcessGroup& shard_group,
                           dist::ProcessGroup* replicate_group, FsdpOptions options,
                           const ParamRangeInit& init)
    : ShardedModel(model, Groups{&shard_group, replicate_group}, options, init) {}

ShardedModel::ShardedModel(nn::LlamaModel& model, Groups groups, FsdpOptions options,
                           const ParamRangeInit& init)
    : model_(model),
      options_(options),
      device_(model.device()),
      shard_group_(groups.shard),
      replicate_group_(groups.replicate),
      alive_(std::make_shared<bool>(true)) {
  ST_CHECK_AS(ConfigError, is_floating(options_.param_dtype) && is_floating(options_.reduce_dtype),
              "sharded training needs floating param and reduce dtypes, got ",
              dtype_name(options_.param_dtype), " and ", dtype_name(options_.reduce_dtype));
  const int S = shard_group_->size(), s = shard_group_->rank();
  // Check every parameter before changing any, so that a refused model is left intact.
  for (auto& [pname, slot] : model.named_parameters())
    ST_CHECK_AS(ConfigError,
                slot->defined() && slot->dtype() == DType::F32 && autograd::requires_grad(*slot) &&
                    autograd::is_leaf(*slot),
                "sharded training needs every parameter to be a trainable fp32 tensor, but '",
                pname, "' is ", slot->defined() ? slot->describe() : std::string("empty"),
                slot->defined() && autograd::requires_grad(*slot) ? "" : " without a gradient",
                " (frozen or quantized models, e.g. QLoRA, train without sharding)");
  // Deferred parameters without an initializer get their values from load_full_parameters. The
  // flag is the same on every rank (they build the same model), so its checks fail together.
  awaiting_values_ = !init && model.has_deferred_parameters();

  auto add_unit = [&](std::string name, bool is_root,
                      std::vector<std::pair<std::string, Tensor*>> params) {
    std::sort(params.begin(), params.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    auto unit = std::make_unique<Unit>();
    unit->name = std::move(name);
    unit->is_root = is_root;
    std::vector<std::pair<std::string, Shape>> shapes;
    for (auto& [pname, slot] : params) {
      shapes.emplace_back(pname, slot->shape());
      unit->slots.push_back(slot);
    }
    unit->layout = FlatParamLayout::build(shapes, S);
    const FlatParamLayout& L = unit->layout;
    {
      CategoryScope scope(MemoryCategory::Parameters);
      unit->shard = zeros({L.shard_numel}, DType::F32, device_);
    }
    unit->piece_layout = L.pieces_of_shard(s);
    for (const auto& p : unit->piece_layout) {
      const Tensor& slot = *unit->slots[static_cast<size_t>(p.param)];
      Tensor dst = unit->shard.slice_rows(p.shard_offset, p.length);
      if (!nn::is_deferred(slot)) {
        Tensor full = slot.detach();
        dst.copy_from(full.view({full.numel()}).slice_rows(p.param_begin, p.length));
      } else if (init) {
        // Only this rank's elements are ever created: the full parameter never exists here.
        fill_from_init(init, L.entries[static_cast<size_t>(p.param)].name, p.param_begin, dst);
      }
      Tensor piece = unit->shard.slice_rows(p.shard_offset, p.length);
      autograd::set_requires_grad(piece);
      unit->pieces.push_back(piece);
    }
    unit->zero_copy = S == 1 && options_.param_dtype == DType::F32;
    if (unit->zero_copy) {
      unit->gathered = unit->shard.impl()->storage;
      unit->state = Unit::State::Gathered;
    } else {
      unit->gathered = std::make_shared<Storage>();
    }
    for (Tensor* slot : unit->slots) *slot = Tensor();  // the full weights are no longer needed
    units_.push_back(std::move(unit));
  };
  for (int i = 0; i < model.num_layers(); ++i)
    add_unit("model.layers." + std::to_string(i), false, model.layer_parameters(i));
  add_unit("root", true, model.root_parameters());

  std::weak_ptr<bool> alive = alive_;
  auto check_alive = [alive]() {
    ST_CHECK(!alive.expired(),
             "the model's sharding (fsdp::ShardedModel) was destroyed; a sharded model cannot "
             "run without it");
  };
  model.add_model_wrapper([this, check_alive](const nn::TensorFn& inner, const Tensor& ids) {
    check_alive();
    begin_forward();
    Unit* first = units_.size() > 1 ? units_[0].get() : nullptr;
    return run_unit(*units_.back(), inner, ids, first);
  });
  model.add_layer_wrapper(
      [this, check_alive](int layer, const nn::TensorFn& inner, const Tensor& x) {
        check_alive();
        size_t i = static_cast<size_t>(layer);
        Unit* next = i + 2 < units_.size() ? units_[i + 1].get() : nullptr;
        return run_unit(*units_.at(i), inner, x, next);
      });
}

ShardedModel::~ShardedModel() {
  *alive_ = false;
  // No waiting here: this may run while an exception unwinds, when other ranks will never join
  // a pending collective. Normal use leaves none pending (backward ends by waiting for its
  // reductions, and every forward frees what it gathered); an abandoned one keeps its buffers.
  for (auto& u : units_) uninstall(*u);
}

// ---- gathering ------------------------------------------------------------------------------

Tensor ShardedModel::gathered_flat(Unit& u) const {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = u.gathered;
  impl->shape = {u.layout.padded};
  impl->dtype = u.zero_copy ? DType::F32 : options_.param_dtype;
  return Tensor(impl);
}

void ShardedModel::start_gather(Unit& u) {
  if (u.state != Unit::State::Sharded) return;
  const int64_t bytes = u.layout.padded * static_cast<int64_t>(dtype_size(options_.param_dtype));
  u.gathered->data = DataPtr(static_cast<size_t>(bytes), device_, MemoryCategory::Parameters);
  Tensor flat = gathered_flat(u);
  if (shard_group_->size() == 1) {
    // One shard (no_shard): the gather is a cast of this rank's own replica, straight into the
    // gathered buffer; a compute-dtype copy of the shard for a collective to read would be a
    // second copy of the whole unit.
    flat.copy_from(u.shard);
    u.gather_work = dist::completed_work();
    u.state = Unit::State::Gathering;
    return;
  }
  Tensor input = u.shard;
  if (options_.param_dtype != DType::F32) {
    CategoryScope scope(MemoryCategory::Parameters);
    input = empty(u.shard.shape(), options_.param_dtype, device_);
    input.copy_from(u.shard);
  }
  u.gather_input = input;
  u.gather_work = shard_group_->all_gather(input, flat);
  if (shard_group_->size() > 1) {
    comm_stats_.all_gathers += 1;
    comm_stats_.gathered_bytes += bytes;
  }
  u.state = Unit::State::Gathering;
}

void ShardedModel::ensure_gathered(Unit& u) {
  if (u.state == Unit::State::Sharded) start_gather(u);
  if (u.state == Unit::State::Gathering) {
    u.gather_work->wait();
    u.gather_work.reset();
    u.gather_input = Tensor();
    u.state = Unit::State::Gathered;
  }
}

void ShardedModel::free_gathered(Unit& u) {
  if (u.zero_copy || u.state == Unit::State::Sharded) return;
  if (u.state == Unit::State::Gathering) ensure_gathered(u);
  u.gathered->data = DataPtr();
  u.state = Unit::State::Sharded;
}

int ShardedModel::num_gathered_units() const {
  int n = 0;
  for (const auto& u : units_)
    if (!u->zero_copy && u->state != Unit::State::Sharded) ++n;
  return n;
}

// ---- forward ----------------------------------------------------------------------------------

std::vector<Tensor> ShardedModel::make_views(Unit& u, bool with_graph) {
  Tensor flat = gathered_flat(u);
  std::vector<Tensor> views;
  for (const auto& e : u.layout.entries)
    views.push_back(flat.slice_rows(e.offset, e.numel).view(e.shape));
  if (with_graph) {
    auto node = std::make_shared<UnitParamsNode>();
    node->owner = this;
    node->unit = &u;
    autograd::attach(node, std::vector<Tensor>{}, views);
    u.node = node;
    u.views = views;
    u.awaiting_backward = true;
    ++awaiting_backward_;
  }
  return views;
}

void ShardedModel::install(Unit& u, const std::vector<Tensor>& views) {
  if (u.installed) return;
  u.saved_slots.clear();
  for (size_t i = 0; i < u.slots.size(); ++i) {
    u.saved_slots.push_back(*u.slots[i]);
    *u.slots[i] = views[i];
  }
  u.installed = true;
}

void ShardedModel::uninstall(Unit& u) {
  if (!u.installed) return;
  for (size_t i = 0; i < u.slots.size(); ++i) *u.slots[i] = u.saved_slots[i];
  u.saved_slots.clear();
  u.installed = false;
}

void ShardedModel::begin_forward() {
  check_has_values();
  if (in_backward_) {
    // The model's forward never runs inside a backward (only layers are recomputed): this is a
    // backward that did not finish, ended by an exception. Its reductions are abandoned.
    in_backward_ = false;
    reduces_.clear();
  }
  if (!autograd::grad_enabled() || awaiting_backward_ == 0) return;
  // A forward with gradients while an earlier one's backward has not run. That is fine only when
  // the earlier graph is gone (its loss was dropped): then its units can be reset.
  for (auto& u : units_) {
    if (!u->awaiting_backward) continue;
    std::shared_ptr<autograd::Node> node = u->node.lock();
    // Our own views hold the node (as their grad_fn); any further owner is a live graph.
    long owners = node ? node.use_count() - 1 : 0;
    ST_CHECK(owners <= static_cast<long>(u->views.size()),
             "a forward pass with gradients started while the previous forward's backward has "
             "not run (unit ",
             u->name,
             "); call backward on each micro-batch's loss before the "
             "next forward, and evaluate under autograd::NoGrad");
  }
  for (auto& u : units_) {
    u->views.clear();
    u->awaiting_backward = false;
    uninstall(*u);
    free_gathered(*u);
    u->grad_accum = Tensor();
  }
  awaiting_backward_ = 0;
}

Tensor ShardedModel::run_unit(Unit& u, const nn::TensorFn& inner, const Tensor& x, Unit* next) {
  const bool grad = autograd::grad_enabled();
  if (in_backward_) {
    // A recompute (activation checkpointing) during backward: the parameters gathered for the
    // backward are used as they are; the unit's backward frees them.
    ensure_gathered(u);
    const bool was_installed = u.installed;
    if (!was_installed) install(u, u.views.empty() ? make_views(u, grad) : u.views);
    Tensor out;
    try {
      out = inner(x);
    } catch (...) {
      if (!was_installed) uninstall(u);
      throw;
    }
    if (!was_installed) uninstall(u);
    if (grad && autograd::requires_grad(out)) {
      Unit* unit = &u;
      autograd::register_hook(out, [this, unit](const Tensor&) {
        pre_backward(*unit);
        return Tensor();
      });
    }
    return out;
  }

  ensure_gathered(u);
  if (options_.prefetch && next != nullptr) start_gather(*next);
  std::vector<Tensor> views = make_views(u, grad);
  install(u, views);
  views.clear();
  Tensor out;
  try {
    out = inner(x);
  } catch (...) {
    uninstall(u);
    throw;
  }
  uninstall(u);

  if (grad && autograd::requires_grad(out)) {
    Unit* unit = &u;
    autograd::register_hook(out, [this, unit](const Tensor&) {
      pre_backward(*unit);
      return Tensor();
    });
    // The root stays gathered: its head runs first in backward, its embedding last.
    // grad_op_shard keeps every unit until its backward (one gather per step); the others free
    // it and gather again for the backward. no_shard's "gather" is the cast of its own replica
    // to the compute dtype (in fp32 there is nothing to free), so no copy of the whole model
    // waits for the backward: its memory is one process's, as plain data parallelism's is.
    if (options_.strategy != ShardingStrategy::GradOpShard && !u.is_root) free_gathered(u);
  } else {
    // No backward will come (evaluation): reshard now.
    if (u.awaiting_backward) {
      u.views.clear();
      u.awaiting_backward = false;
      --awaiting_backward_;
    }
    free_gathered(u);
    if (u.is_root)
      for (auto& other : units_) free_gathered(*other);  // an unused prefetch
  }
  return out;
}

// ---- backward ---------------------------------------------------------------------------------

ShardedModel::Unit* ShardedModel::previous_in_backward(Unit& u) {
  if (u.is_root) return units_.size() > 1 ? units_[units_.size() - 2].get() : nullptr;
  for (size_t i = 1; i + 1 < units_.size(); ++i)
    if (units_[i].get() == &u) return units_[i - 1].get();
  return nullptr;
}

void ShardedModel::pre_backward(Unit& u) {
  in_backward_ = true;
  ensure_gathered(u);
  // A reentrant recompute of this unit reads the parameter slots.
  if (!u.is_root && !u.views.empty()) install(u, u.views);
  if (options_.prefetch) {
    Unit* prev = previous_in_backward(u);
    if (prev != nullptr) start_gather(*prev);
  }
}

Tensor ShardedModel::flatten_grads(Unit& u, const std::vector<Tensor>& grads, DType dtype) const {
  Tensor flat = make_gradient({u.layout.padded}, dtype, device_);
  for (size_t i = 0; i < u.layout.entries.size(); ++i) {
    const auto& e = u.layout.entries[i];
    Tensor dst = flat.slice_rows(e.offset, e.numel);
    dst.copy_from(grads[i]);
  }
  return flat;
}

bool ShardedModel::syncs_gradients_now() const {
  return options_.sync_every_microbatch || microbatch_ + 1 >= microbatches_;
}

void ShardedModel::set_microbatch(int index, int count) {
  ST_CHECK(count >= 1 && index >= 0 && index < count, "micro-batch ", index, " of ", count);
  microbatch_ = index;
  microbatches_ = count;
}

void ShardedModel::post_backward(Unit& u, std::vector<Tensor>& grads) {
  uninstall(u);
  u.views.clear();
  if (u.awaiting_backward) {
    u.awaiting_backward = false;
    --awaiting_backward_;
  }
  free_gathered(u);

  const bool sync = syncs_gradients_now();
  if (!sync || u.grad_accum.defined()) {
    Tensor g = flatten_grads(u, grads, DType::F32);
    grads.clear();
    if (u.grad_accum.defined())
      backend_for(device_).add(u.grad_accum, g, u.grad_accum, 1.0f, 1.0f);
    else
      u.grad_accum = g;
    if (sync) {
      Tensor flat = u.grad_accum;
      u.grad_accum = Tensor();
      if (options_.reduce_dtype != DType::F32) {
        CategoryScope scope(MemoryCategory::Gradients);
        flat = flat.to(options_.reduce_dtype);
      }
      launch_reduce(u, flat);
    }
  } else {
    Tensor flat = flatten_grads(u, grads, options_.reduce_dtype);
    grads.clear();
    launch_reduce(u, flat);
  }
  if (awaiting_backward_ == 0) finish_backward();
}

void ShardedModel::launch_reduce(Unit& u, Tensor flat) {
  auto p = std::make_unique<PendingReduce>();
  p->unit = &u;
  p->flat = flat;
  if (shard_group_->size() == 1) {
    p->out = flat;
    p->work = dist::completed_work();
  } else {
    p->out = make_gradient({u.layout.shard_numel}, options_.reduce_dtype, device_);
    p->work = shard_group_->reduce_scatter(flat, p->out);
    comm_stats_.reduce_scatters += 1;
    comm_stats_.reduce_scattered_bytes += static_cast<int64_t>(flat.nbytes());
  }
  reduces_.push_back(std::move(p));
  // At most one reduction stays in flight: the unsharded gradients of earlier units must not
  // pile up (that would hold the whole unsharded gradient).
  while (reduces_.size() > 1) complete_oldest_reduce();
}

void ShardedModel::complete_oldest_reduce() {
  std::unique_ptr<PendingReduce> p = std::move(reduces_.front());
  reduces_.erase(reduces_.begin());
  p->work->wait();
  p->flat = Tensor();
  if (replicate_group_ != nullptr) {
    replicate_group_->all_reduce(p->out, dist::ReduceOp::Sum)->wait();
    comm_stats_.all_reduces += 1;
    comm_stats_.all_reduced_bytes += static_cast<int64_t>(p->out.nbytes());
  }
  Unit& u = *p->unit;
  Backend& be = backend_for(device_);
  for (size_t k = 0; k < u.pieces.size(); ++k) {
    const auto& piece = u.piece_layout[k];
    Tensor src = p->out.slice_rows(piece.shard_offset, piece.length);
    Tensor& param = u.pieces[k];
    Tensor g = autograd::grad(param);
    if (!g.defined()) {
      Tensor fresh = make_gradient({piece.length}, DType::F32, device_);
      fresh.copy_from(src);
      autograd::set_grad(param, fresh);
    } else {
      Tensor add = src;
      if (add.dtype() != DType::F32) {
        CategoryScope scope(MemoryCategory::Gradients);
        add = src.to(DType::F32);
      }
      be.add(g, add, g, 1.0f, 1.0f);
    }
  }
}

void ShardedModel::wait_for_gradients() {
  while (!reduces_.empty()) complete_oldest_reduce();
}

void ShardedModel::finish_backward() {
  wait_for_gradients();
  for (auto& u : units_) {
    uninstall(*u);
    free_gathered(*u);
  }
  in_backward_ = false;
}

// ---- step helpers -----------------------------------------------------------------------------

std::vector<optim::NamedParam> ShardedModel::optimizer_params() {
  std::vector<optim::NamedParam> out;
  for (auto& u : units_)
    for (size_t k = 0; k < u->pieces.size(); ++k)
      out.push_back(
          {u->layout.entries[static_cast<size_t>(u->piece_layout[k].param)].name, &u->pieces[k]});
  return out;
}

std::vector<ParamPiece> ShardedModel::param_pieces() const {
  std::vector<ParamPiece> out;
  for (const auto& u : units_)
    for (const auto& p : u->piece_layout) {
      const auto& e = u->layout.entries[static_cast<size_t>(p.param)];
      out.push_back({e.name, e.shape, p.param_begin, p.length});
    }
  return out;
}

double ShardedModel::grad_sum_squares() {
  wait_for_gradients();
  double local = optim::grad_sum_squares(optimizer_params());
  // Replicas hold equal gradients: sum over one copy of the model (the shard group).
  return shard_group_->all_reduce_host(local, dist::ReduceOp::Sum);
}

bool ShardedModel::any_rank(bool flag) {
  // The shard group and the replicate group together span every rank: after the first
  // reduction each rank holds its shard group's answer, after the second everyone's.
  int64_t any =
      shard_group_->all_reduce_host(static_cast<int64_t>(flag ? 1 : 0), dist::ReduceOp::Max);
  if (replicate_group_ != nullptr)
    any = replicate_group_->all_reduce_host(any, dist::ReduceOp::Max);
  return any > 0;
}

void ShardedModel::check_has_values() const {
  ST_CHECK(!awaiting_values_,
           "the sharded model was built from deferred parameters (no storage) without an "
           "initializer, and no weights have been loaded since: pass fsdp::seeded_init(model, "
           "seed) to the ShardedModel, or call load_full_parameters before using the weights");
}

// ---- full state -------------------------------------------------------------------------------

Tensor ShardedModel::full_flat(Unit& u, bool gradients) {
  Tensor local = u.shard;
  CategoryScope scope(MemoryCategory::Workspace);
  if (gradients) {
    local = zeros({u.layout.shard_numel}, DType::F32, device_);
    for (size_t k = 0; k < u.pieces.size(); ++k) {
      Tensor g = autograd::grad(u.pieces[k]);
      if (!g.defined()) continue;
      Tensor dst = local.slice_rows(u.piece_layout[k].shard_offset, u.piece_layout[k].length);
      dst.copy_from(g);
    }
  }
  if (shard_group_->size() == 1) return local;
  Tensor full = empty({u.layout.padded}, DType::F32, device_);
  shard_group_->all_gather(local, full)->wait();
  return full;
}

void ShardedModel::for_each_full_parameter(const FullTensorFn& fn) {
  check_has_values();
  wait_for_gradients();
  for (size_t n = 0; n < units_.size(); ++n) {
    Unit& u = *units_[(n + units_.size() - 1) % units_.size()];  // root first
    Tensor full = full_flat(u, false);
    for (const auto& e : u.layout.entries)
      fn(e.name, full.slice_rows(e.offset, e.numel).view(e.shape));
  }
}

void ShardedModel::for_each_full_gradient(const FullTensorFn& fn) {
  wait_for_gradients();
  for (size_t n = 0; n < units_.size(); ++n) {
    Unit& u = *units_[(n + units_.size() - 1) % units_.size()];
    Tensor full = full_flat(u, true);
    for (const auto& e : u.layout.entries)
      fn(e.name, full.slice_rows(e.offset, e.numel).view(e.shape));
  }
}

void ShardedModel::load_full_parameters(const std::function<Tensor(const std::string&)>& get) {
  for (auto& u : units_) {
    // Each piece is the part of one parameter in this rank's shard: one full parameter is asked
    // for (and may be held by `get`) at a time.
    for (const auto& p : u->piece_layout) {
      const auto& e = u->layout.entries[static_cast<size_t>(p.param)];
      Tensor full = get(e.name);
      ST_CHECK_SHAPE(full.defined() && full.numel() == e.numel, "loading '", e.name, "': expected ",
                     e.numel, " elements ", shape_str(e.shape), ", got ",
                     full.defined() ? full.describe() : std::string("nothing"));
      ST_CHECK_SHAPE(is_floating(full.dtype()), "loading '", e.name,
                     "': expected a floating tensor, got ", full.describe());
      Tensor dst = u->shard.slice_rows(p.shard_offset, p.length);
      dst.copy_from(full.view({full.numel()}).slice_rows(p.param_begin, p.length));
    }
    if (!u->zero_copy) free_gathered(*u);  // a stale gathered copy must not survive a load
  }
  awaiting_values_ = false;
}

const std::string& ShardedModel::unit_name(int unit) const {
  return units_.at(static_cast<size_t>(unit))->name;
}

const FlatParamLayout& ShardedModel::unit_layout(int unit) const {
  return units_.at(static_cast<size_t>(unit))->layout;
}

}  // namespace shardtrain::fsdp
