#include "engine/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <numeric>

#include <ATen/core/CachingHostAllocator.h>
#include <torch/torch.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "c10/util/Exception.h"
#include "common/files.h"
#include "engine/loss.h"
#include "engine/parallel/ulysses.h"
#include "engine/profiler.h"
#include "model/hybrid.h"
#include "model/moe.h"
#include "model/safetensors.h"
#include "model/weights.h"
#include "nlohmann/json.hpp"

namespace odyssey::engine {

namespace {

// Turns the DSA layers' indexer backward in the forward on for one step and off again.
class IndexerBackwardInForward {
 public:
  explicit IndexerBackwardInForward(model::CausalLM& m) : m_(m) { Set(true); }
  ~IndexerBackwardInForward() { Set(false); }
  IndexerBackwardInForward(const IndexerBackwardInForward&) = delete;
  IndexerBackwardInForward& operator=(const IndexerBackwardInForward&) = delete;

 private:
  void Set(bool on) {
    for (model::DecoderLayer& layer : m_->model->layer_list)
      if (layer->dsa) layer->dsa->set_indexer_backward_in_forward(on);
  }
  model::CausalLM& m_;
};

// The host optimizer's options for a job: the trainer's threads and chunking, the moments' dtype
// the memory strategy's alone (Create validated it against optimizer_on_host), so no second
// switch can ask the device optimizer for bf16 moments.
HostOptimizerOptions HostOptionsOf(const TrainerOptions& o) {
  HostOptimizerOptions h = o.host_optimizer;
  h.bf16_moments = o.memory.bf16_moments;
  return h;
}

}  // namespace

absl::StatusOr<torch::Device> ParseDevice(const std::string& name) {
  if (name == "auto") return torch::cuda::is_available() ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  if (name == "cpu") return torch::Device(torch::kCPU);
  if (name.rfind("cuda", 0) == 0) {
    if (!torch::cuda::is_available())
      return absl::FailedPreconditionError(absl::StrCat("device '", name, "': this build or machine has no CUDA device"));
    int index = 0;
    if (name.size() > 4) {
      // Digits only, and small enough for an int (std::stoi would throw on "cuda:99999999999").
      if (name[4] != ':' || name.size() == 5 || name.find_first_not_of("0123456789", 5) != std::string::npos ||
          !absl::SimpleAtoi(absl::string_view(name).substr(5), &index))
        return absl::InvalidArgumentError(absl::StrCat("device '", name, "' must be cpu, cuda or cuda:N"));
    }
    if (index >= static_cast<int>(torch::cuda::device_count()))
      return absl::InvalidArgumentError(absl::StrCat("device '", name, "': only ", torch::cuda::device_count(), " CUDA devices"));
    return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
  }
  return absl::InvalidArgumentError(absl::StrCat("device '", name, "' must be auto, cpu, cuda or cuda:N"));
}

absl::Status TrainerOptions::Validate() const {
  if (steps <= 0) return absl::InvalidArgumentError(absl::StrCat("steps (", steps, ") must be > 0"));
  if (rl_group_tokens < 0)
    return absl::InvalidArgumentError(absl::StrCat("rl_group_tokens (", rl_group_tokens, ") must be >= 0"));
  if (absl::Status s = optimizer.Validate(); !s.ok()) return s;
  if (absl::Status s = schedule.Validate(); !s.ok()) return s;
  // The moments' dtype is the memory strategy's alone (HostOptionsOf): a second switch that
  // asked for bf16 moments without it would be ignored, so it is refused.
  if (host_optimizer.bf16_moments && !memory.bf16_moments)
    return absl::InvalidArgumentError(
        "host_optimizer.bf16_moments must be false: the moments' dtype is set by memory.bf16_moments");
  return absl::OkStatus();
}

Trainer::~Trainer() {
  // What memory.keep_selection keeps between a DSA layer's passes is pinned memory from
  // libtorch's caching host allocator, which holds freed blocks for reuse (up to ~14 GiB after a
  // 1M-token hybrid-3b step): a worker's next job, whose host pool uses cudaHostAlloc, could not
  // have it. What a failed step left kept goes first.
  for (const model::DecoderLayer& layer : model_->model->layer_list) {
    if (layer->dsa) layer->dsa.ptr()->ClearSelections();
  }
  if (device_.is_cuda()) at::getHostAllocator(at::kCUDA)->empty_cache();
}

Trainer::Trainer(TrainerOptions options, model::CausalLM model, std::unique_ptr<DataSource> data,
                 torch::Device device, torch::Dtype dtype)
    : options_(std::move(options)), model_(std::move(model)), data_(std::move(data)), device_(device), dtype_(dtype) {
  std::vector<std::pair<std::string, torch::Tensor>> named;
  layer_params_.resize(static_cast<size_t>(model_->config().num_hidden_layers));
  const std::string layers_prefix = "model.layers.";
  for (auto& p : model_->named_parameters()) {
    // Frozen parameters (a LoRA job's base weights) get no gradient and no optimizer state.
    if (!p.value().requires_grad()) continue;
    const int64_t index = static_cast<int64_t>(params_.size());
    const std::string& name = p.key();
    if (name.rfind("model.embed_tokens.", 0) == 0) {
      embed_params_.push_back(index);
    } else if (name.rfind(layers_prefix, 0) == 0) {
      const size_t layer = std::stoul(name.substr(layers_prefix.size()));
      TORCH_CHECK(layer < layer_params_.size(), "parameter ", name, " of a layer the config does not have");
      layer_params_[layer].push_back(index);
    } else {
      tail_params_.push_back(index);
    }
    named.emplace_back(name, p.value());
    params_.push_back(p.value());
  }
  // Sharded: the optimizer is built over the shards (ShardParameters), never over whole tensors.
  if (!options_.shard_params)
    optimizer_ = std::make_unique<AdamW>(std::move(named), options_.optimizer, options_.memory.optimizer_on_host,
                                         HostOptionsOf(options_));
  if (options_.schedule.total_steps == 0) options_.schedule.total_steps = options_.steps;
}

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(const TrainerOptions& options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  absl::StatusOr<torch::Device> device = ParseDevice(options.device);
  if (!device.ok()) return device.status();
  torch::Dtype dtype = device->is_cuda() ? torch::kBFloat16 : torch::kFloat32;
  if (options.dtype != "auto") {
    absl::StatusOr<torch::Dtype> d = model::ParseDtype(options.dtype);
    if (!d.ok()) return d.status();
    dtype = *d;
  }
  const int64_t head_groups = options.memory.head_groups;
  const model::ModelOverrides overrides{options.num_layers, options.indexer_stage, options.kda_chunk_size};
  absl::StatusOr<model::ModelConfig> resolved = model::ResolveModelConfig(options.model, overrides);
  if (!resolved.ok()) return resolved.status();
  if (absl::Status s = options.memory.ValidateForModel(resolved->num_hidden_layers, resolved->num_key_value_heads);
      !s.ok())
    return s;
  if (absl::Status s = options.lora.Validate("lora", &*resolved); !s.ok()) return s;
  const ContextParallelOptions& cp = options.context_parallel;
  const int64_t P = cp.degree();
  if (options.memory.keep_selection &&
      !(resolved->NumLayersOfKind('D') > 0 && resolved->hybrid.indexer_stage == model::IndexerStage::kSparse))
    return absl::InvalidArgumentError(absl::StrCat("memory.keep_selection acts on DSA layers in the sparse indexer "
                                                   "stage; model '", options.model, "' has none"));
  if (resolved->IsHybrid()) {
    // What acts on the dense attention only is refused for the KDA and DSA layers, by name.
    const std::string why = absl::StrCat(" is not implemented for the hybrid family (model '", options.model,
                                         "'): its KDA and DSA layers do not run through the dense attention backend");
    if (options.memory.keep_attention) return absl::InvalidArgumentError(absl::StrCat("memory.keep_attention", why));
    if (const std::string no = resolved->HeadGroupsRefusal(head_groups, P); !no.empty())
      return absl::InvalidArgumentError(absl::StrCat("memory.head_groups (", head_groups, ")", no));
    if (P > 1) {
      // Context parallelism runs inside the KDA and DSA layers (model/hybrid.h): their heads
      // split over the ranks, the sequence's tiles broadcast by the rank that holds them.
      const std::string cp_field = absl::StrCat("parallel.context_parallel (", P, ")");
      const model::HybridConfig& hy = resolved->hybrid;
      if (resolved->NumLayersOfKind('K') > 0 && hy.kda_num_heads % P != 0)
        return absl::InvalidArgumentError(absl::StrCat(cp_field, " must divide the KDA layers' heads (",
                                                       hy.kda_num_heads, ")"));
      if (resolved->NumLayersOfKind('D') > 0) {
        if (resolved->num_key_value_heads % P != 0)
          return absl::InvalidArgumentError(absl::StrCat(cp_field, " must divide the DSA layers' KV heads (",
                                                         resolved->num_key_value_heads, ")"));
        if (options.data.seq_len % (4 * P) != 0)
          return absl::InvalidArgumentError(absl::StrCat(
              "data.seq_len (", options.data.seq_len, ") must be a multiple of 4 x ", cp_field,
              " for the DSA layers: each rank's positions are whole pools of 4 counted from the first token"));
        if (hy.indexer_stage != model::IndexerStage::kSparse)
          return absl::InvalidArgumentError(absl::StrCat(cp_field, " with the dense_warmup indexer stage", why));
      }
      if (cp.head_chunk > 0)
        return absl::InvalidArgumentError(absl::StrCat("context_parallel.head_chunk (", cp.head_chunk, ")", why));
      if (options.data.format == "jsonl")
        return absl::InvalidArgumentError(absl::StrCat(
            cp_field, " with data.format jsonl (packed documents) is not implemented for the hybrid family (model '",
            options.model, "'): its KDA state and DSA pools would restart inside other ranks' positions"));
    }
  }
  if (cp.group != nullptr) {
    if (absl::Status s = ValidateContextParallel(P, cp.head_chunk, resolved->num_attention_heads,
                                                 resolved->num_key_value_heads, options.data.seq_len);
        !s.ok())
      return s;
    // Head groups run inside the all-to-all, on the KV heads one rank holds in one round.
    const int64_t G = cp.head_chunk > 0 ? cp.head_chunk : resolved->num_attention_heads;
    const int64_t round_kv = std::max<int64_t>(1, G * resolved->num_key_value_heads / resolved->num_attention_heads);
    const int64_t rank_kv = std::lcm(round_kv, P) / P;
    if (head_groups > 1 && rank_kv % head_groups != 0)
      return absl::InvalidArgumentError(absl::StrCat("memory.head_groups (", head_groups,
                                                     ") must divide the KV heads a context-parallel rank holds per "
                                                     "round (", rank_kv, ")"));
  }
  absl::StatusOr<std::shared_ptr<const kernels::AttentionBackend>> backend =
      kernels::MakeAttentionBackend(options.attention, head_groups);
  if (!backend.ok()) return backend.status();
  absl::StatusOr<std::unique_ptr<memory::MemoryStack>> memory =
      memory::MemoryStack::Create(options.memory, resolved->num_hidden_layers);
  if (!memory.ok()) return memory.status();
  // The host pool comes before the model's weights: a job that cannot fit fails fast.
  // A context-parallel rank saves its shard's S/P positions per layer.
  if (absl::Status s =
          (*memory)->Prepare(options.data.batch_size, options.data.seq_len / P, resolved->hidden_size, dtype);
      !s.ok())
    return s;
  if (options.memory.keep_attention) {
    // Head groups wrap the stashing backend, which wraps the kernel: one record per group.
    absl::StatusOr<std::shared_ptr<const kernels::AttentionBackend>> kernel = kernels::MakeAttentionBackend(options.attention);
    if (!kernel.ok()) return kernel.status();
    if (!(*kernel)->SupportsStats(*device))
      return absl::InvalidArgumentError(absl::StrCat("memory.keep_attention needs an attention backend whose forward "
                                                     "statistics and backward run separately (math, or cudnn/auto on "
                                                     "CUDA); '", options.attention, "' on ", device->str(), " has none"));
    backend = kernels::WrapHeadGroups(
        std::make_shared<const memory::StashingAttention>(*kernel, (*memory)->attention_stash()), head_groups);
  }
  // Context parallel: Ulysses is the outermost backend (documents are split on whole rows, after
  // its all-to-all); head groups, the stash and the kernel run on the rank's heads of whole rows.
  if (cp.group != nullptr)
    backend = std::shared_ptr<const kernels::AttentionBackend>(
        std::make_shared<const UlyssesAttention>(*backend, *cp.group, cp.head_chunk));
  absl::StatusOr<model::CausalLM> m = model::LoadModel(options.model, overrides, dtype, *device, options.seed);
  if (!m.ok()) return m.status();
  (*m)->set_attention_backend(*backend);
  if (P > 1 && (*m)->config().IsHybrid())
    (*m)->set_sequence_group(std::make_shared<const CommunicatorSequenceGroup>(*cp.group));
  if (absl::Status s = model::AttachLora(**m, options.lora, options.seed); !s.ok()) return s;
  const model::ModelConfig& config = (*m)->config();
  // The indexer's dense warm-up (spec 2.3): only the DSA layers' indexers train, from their KL
  // against the dense attention; every other weight is frozen (no gradient, no optimizer state).
  if (config.InDenseWarmup()) {
    const std::string stage = absl::StrCat(" with the dense_warmup indexer stage (model '", options.model,
                                           "'), where only the DSA indexers train");
    if (options.lora.enabled())
      return absl::InvalidArgumentError(absl::StrCat("lora.rank (", options.lora.rank, ")", stage,
                                                     ": the indexers have no adapters; warm up without LoRA"));
    if (options.shard_params)
      return absl::UnimplementedError(absl::StrCat("shard_params (true)", stage,
                                                   ", is not implemented (the indexers are small: train them unsharded)"));
    torch::NoGradGuard no_grad;
    for (auto& p : (*m)->named_parameters())
      p.value().requires_grad_(p.key().find(".indexer.") != std::string::npos);
  }
  if (options.data.seq_len > config.max_position_embeddings)
    return absl::InvalidArgumentError(absl::StrCat("data.seq_len (", options.data.seq_len,
                                                   ") must be <= the model's max_position_embeddings (",
                                                   config.max_position_embeddings, ")"));
  std::unique_ptr<Communicator> alone;
  Communicator* comm = options.communicator;
  if (comm == nullptr) {
    alone = std::make_unique<SingleRankCommunicator>();
    comm = alone.get();
  }
  DataOptions data_options = options.data;
  data_options.vocab_size = config.vocab_size;
  data_options.seed += static_cast<uint64_t>(comm->rank());  // each rank its own batches
  absl::StatusOr<std::unique_ptr<DataSource>> data = OpenDataSource(data_options);
  if (!data.ok()) return data.status();
  auto trainer = std::unique_ptr<Trainer>(new Trainer(options, *std::move(m), *std::move(data), *device, dtype));
  trainer->memory_ = *std::move(memory);
  trainer->runner_ = trainer->memory_->Runner();
  if (options.memory.optimizer_on_host || options.shard_params) trainer->HookHostOptimizer();
  // Data parallel, applied to the plain model from outside its steps: every rank starts from
  // rank 0's weights, and the steps sum the ranks' gradients through one reducer (identities
  // on one rank).
  trainer->alone_ = std::move(alone);
  trainer->comm_ = comm;
  // Each data-parallel replica's indexer KL enters the summed gradients as its share of the
  // replicas' mean (the LM loss's share is its targets'; model/hybrid.h).
  // The DSA layers' sparse stage runs its backward in the memory stack's KV-head groups (the
  // dense warm-up's attention through the backend above).
  for (model::DecoderLayer layer : trainer->model_->model->layer_list) {  // holders: shared_ptrs
    if (!layer->dsa) continue;
    layer->dsa->set_gradient_scale(1.0 / comm->world_size());
    layer->dsa->set_head_groups(head_groups);
  }
  {
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> params = trainer->params_;
    if (absl::Status s = comm->Broadcast(params, 0); !s.ok()) return s;
    if (P > 1)
      if (absl::Status s = cp.group->Broadcast(params, 0); !s.ok()) return s;
  }
  if (options.shard_params) {
    // ZeRO-3 over the job's ranks, after every rank holds rank 0's weights.
    if (options.lora.enabled())
      return absl::UnimplementedError("shard_params: sharding a LoRA job is not implemented (its adapters are small: "
                                      "train them unsharded)");
    if (P > 1 && comm->world_size() > 1)
      return absl::UnimplementedError(absl::StrCat("shard_params: sharding over both the context-parallel group (", P,
                                                   ") and data-parallel ranks (", comm->world_size(),
                                                   ") is not implemented; shard over one of them"));
    if (absl::Status s = trainer->ShardParameters(P > 1 ? *cp.group : *comm); !s.ok()) return s;
  }
  trainer->gradients_ = std::make_unique<GradientReducer>(*comm, trainer->params_);
  if (P > 1) trainer->cp_gradients_ = std::make_unique<GradientReducer>(*cp.group, trainer->params_);
  return trainer;
}

std::vector<int64_t> Trainer::LayerParams(int64_t first, int64_t count) const {
  std::vector<int64_t> out;
  for (int64_t l = first; l < first + count; ++l) {
    const std::vector<int64_t>& layer = layer_params_.at(static_cast<size_t>(l));
    out.insert(out.end(), layer.begin(), layer.end());
  }
  return out;
}

void Trainer::HookHostOptimizer() {
  memory::LayerHooks hooks;
  hooks.before_forward = [this](int64_t first, int64_t count) {
    optimizer_->WaitParams(LayerParams(first, count));
    if (!shards_) return;
    // Unit 1 + l is layer l; the next group's layers travel while this one computes.
    for (int64_t l = first; l < first + count; ++l) GatherUnit(1 + l);
    const int64_t L = static_cast<int64_t>(layer_params_.size());
    for (int64_t l = first + count; l < std::min(first + 2 * count, L); ++l) PrefetchUnit(1 + l);
  };
  // Runs on autograd's device thread on CUDA, while the training thread waits in backward().
  hooks.after_backward = [this](int64_t first, int64_t count) {
    if (shards_)
      for (int64_t l = first; l < first + count; ++l) shards_->ReduceGradients(1 + l);
    if (send_grads_early_) {
      const std::vector<int64_t> params = LayerParams(first, count);
      // Data-parallel replicas: the group's gradients summed over the ranks first, so that what
      // leaves is the global batch's (the step's Reduce skips them). A failed collective throws
      // out of the backward, as a sharded reduce-scatter's does.
      if (!shards_ && DataParallel()) {
        const absl::Status s = gradients_->ReduceEarly(params);
        TORCH_CHECK(s.ok(), "data-parallel all-reduce of layers ", first, " to ", first + count - 1,
                    "'s gradients: ", s.message());
      }
      optimizer_->GradsReady(params);
      params_sent_in_backward_ += static_cast<int64_t>(params.size());
      // Sent: off the GPU now (the clip counts their norms). Sharded, the shards' clip reads
      // every shard's gradient: they stay.
      if (!shards_) optimizer_->ReleaseGrads(params);
    }
  };
  if (options_.shard_params) {  // shards_ is built after the hooks
    hooks.after_forward = [this](int64_t first, int64_t count, bool kept) {
      if (kept) return;  // autograd holds the whole weights for the backward: freed after it
      for (int64_t l = first; l < first + count; ++l) shards_->Release(1 + l);
    };
    hooks.before_recompute = [this](int64_t first, int64_t count) {
      for (int64_t l = first; l < first + count; ++l) GatherUnit(1 + l);
      for (int64_t l = std::max<int64_t>(0, first - count); l < first; ++l) PrefetchUnit(1 + l);
    };
  }
  memory_->set_layer_hooks(std::move(hooks));
}

torch::Tensor Trainer::Hidden(const model::ForwardInputs& in) {
  const int64_t L = static_cast<int64_t>(layer_params_.size());
  if (shards_) {
    GatherUnit(0);  // the embedding (and a tied head), whole until the backward ends
    if (!hooked_runner_)
      for (int64_t l = 0; l < L; ++l) GatherUnit(1 + l);  // a caller's runner fires no hooks
  }
  optimizer_->WaitParams(embed_params_);
  if (!hooked_runner_) optimizer_->WaitParams(LayerParams(0, L));
  // The final norm (and an untied head, read by the loss) after the layers: their update is
  // the last the host threads do.
  model::LayerStackRunner runner = [this, L](const std::vector<model::DecoderLayer>& layers, const torch::Tensor& h0,
                                             const model::LayerContext& ctx) {
    torch::Tensor h = h0;  // (B, S, hidden)
    if (runner_) {
      h = runner_(layers, h0, ctx);
    } else {
      for (model::DecoderLayer layer : layers) h = layer->forward(h, ctx);  // holders are shared_ptrs
    }
    optimizer_->WaitParams(tail_params_);
    if (shards_) GatherUnit(1 + L);
    return h;
  };
  return model_->Hidden(in, runner);
}

torch::Tensor Trainer::Loss(const Batch& batch, int64_t* targets) {
  model::ForwardInputs in;
  in.input_ids = batch.input_ids.to(device_);
  in.position_ids = batch.position_ids.to(device_);
  in.doc_lens = &batch.doc_lens;
  torch::Tensor hidden = Hidden(in);  // (B, S, hidden)
  torch::Tensor mask = batch.loss_mask.to(device_);
  *targets = batch.NumTargets();
  ProfilePhase phase("loss");
  torch::Tensor sum = memory_->LossSum(hidden, model_->HeadWeight(), batch.labels.to(device_), mask);
  torch::Tensor loss = sum / static_cast<double>(std::max<int64_t>(1, *targets));
  aux_loss_ = torch::Tensor();
  const model::MoeConfig& moe = model_->config().moe;
  if (moe.enabled() && moe.output_router_logits && moe.router_aux_loss_coef > 0) {
    // transformers' rule: loss += router_aux_loss_coef * load-balancing loss (model/moe.h).
    aux_loss_ = model::MoeAuxLoss(model::MoeLayers(*model_), moe.router_aux_loss_coef, hidden);
    loss = loss + aux_loss_;
  }
  return loss;
}

Batch Trainer::LocalShard(const Batch& batch) const {
  const int64_t P = ContextParallelDegree();
  if (P == 1) return batch;
  return ShardBatch(batch, options_.context_parallel.group->rank(), P);
}

absl::StatusOr<TokenShare> Trainer::ShareTokens(int64_t local_targets, int64_t local_positions) {
  int64_t targets = local_targets, positions = local_positions;
  if (cp_gradients_) {
    absl::StatusOr<TokenShare> group = cp_gradients_->ShareTokens(local_targets, local_positions);
    if (!group.ok()) return group.status();
    targets = group->targets;
    positions = group->positions;
  }
  absl::StatusOr<TokenShare> share = gradients_->ShareTokens(targets, positions);
  if (!share.ok()) return share.status();
  share->loss_scale = static_cast<double>(std::max<int64_t>(1, local_targets)) /
                      static_cast<double>(std::max<int64_t>(1, share->targets));
  return share;
}

absl::Status Trainer::ReduceGradients(std::vector<torch::Tensor>& riders) {
  if (shards_) {
    // The layers' gradients were reduce-scattered by their backward hooks; the units still whole
    // (embedding, head, layers without recompute) are now. Only the riders are summed whole.
    if (absl::Status s = shards_->FinishBackward(); !s.ok()) return s;
    if (cp_gradients_)
      if (absl::Status s = options_.context_parallel.group->AllReduce(riders, ReduceOp::kSum); !s.ok()) return s;
    return comm_->AllReduce(riders, ReduceOp::kSum);
  }
  if (cp_gradients_)
    if (absl::Status s = cp_gradients_->Reduce(riders); !s.ok()) return s;
  return gradients_->Reduce(riders);
}

bool Trainer::IndexerBackwardInForwardStep() const { return model_->config().InDenseWarmup(); }

absl::StatusOr<torch::Tensor> Trainer::ReducedGradients(const Batch& whole, TokenShare* share_out,
                                                       bool send_early) {
  const Batch batch = LocalShard(whole);  // (B, S/P) under context parallelism
  // Target and position counts over all ranks first: each rank's loss is scaled by its share of
  // the global targets, so the summed gradients are those of the mean over the global batch.
  absl::StatusOr<TokenShare> share = ShareTokens(batch.NumTargets(), batch.input_ids.numel());
  if (!share.ok()) return share.status();
  *share_out = *share;
  int64_t local_targets = 0;
  torch::Tensor loss;  // () this rank's share
  // One backward per step: each checkpointed layer group's gradients are final when its
  // backward ends, so they may go to a host optimizer then, data-parallel replicas' after their
  // all-reduce in the same hook (sharded ranks reduce-scatter there instead and keep theirs to
  // the step; context-parallel ranks sum over two groups after the backward). The planner's
  // mirror of this rule: planner::GradientsToStep.
  send_grads_early_ = send_early && (!DataParallel() || !shards_) && ContextParallelDegree() == 1 &&
                      !IndexerBackwardInForwardStep();
  params_sent_in_backward_ = 0;
  try {
    if (IndexerBackwardInForwardStep()) {
      // The dense warm-up: nothing but the indexers trains and their input is detached, so the
      // only gradients are the indexers' KLs', each sent inside its layer's forward (the
      // gradient the KL's InjectAuxLoss would send back). The layers run without grad: no
      // backward through them and nothing saved for one.
      IndexerBackwardInForward scope(model_);
      torch::NoGradGuard no_grad;
      loss = Loss(batch, &local_targets) * share->loss_scale;
    } else {
      loss = Loss(batch, &local_targets) * share->loss_scale;
      ProfilePhase phase("backward");
      loss.backward();
    }
  } catch (...) {
    // The gradients of a half-done step (and what was sent of them) must not reach the next.
    send_grads_early_ = false;
    gradients_->Forget();
    optimizer_->ZeroGrad();
    if (shards_) shards_->ReleaseAll();
    throw;
  }
  send_grads_early_ = false;
  // The loss shares ride the gradients' all-reduce: their sum is the global batch's mean.
  std::vector<torch::Tensor> riders = {loss.detach().to(torch::kFloat32).reshape({1})};  // (1,)
  if (absl::Status s = ReduceGradients(riders); !s.ok()) {
    optimizer_->ZeroGrad();
    return s;
  }
  return riders[0];
}

absl::StatusOr<BatchGradients> Trainer::Gradients(const Batch& batch) {
  optimizer_->Finish();
  model_->train();
  TokenShare share;
  // Nothing goes to a host optimizer: no update follows.
  absl::StatusOr<torch::Tensor> loss = ReducedGradients(batch, &share, /*send_early=*/false);
  if (!loss.ok()) return loss.status();
  BatchGradients out;
  out.loss = loss->item<double>();
  if (shards_) {
    absl::StatusOr<std::map<std::string, torch::Tensor>> whole = shards_->WholeGradients();
    if (!whole.ok()) return whole.status();
    out.grads = *std::move(whole);
  }
  for (auto& p : model_->named_parameters())
    if (!shards_ && p.value().grad().defined()) out.grads[p.key()] = p.value().grad().detach().clone();
  optimizer_->ZeroGrad();
  return out;
}

StepResult Trainer::Step(const Batch& whole) {
  const auto t0 = std::chrono::steady_clock::now();
  model_->train();
  StepResult r;
  TokenShare share_value;
  absl::StatusOr<torch::Tensor> rider = ReducedGradients(whole, &share_value, /*send_early=*/true);
  if (!rider.ok()) {
    r.status = rider.status();
    return r;
  }
  const TokenShare* share = &share_value;
  r.target_tokens = share->targets;
  // Clipping on the device: the device update is queued behind the backward without the host
  // waiting (a host update reads the factor once: it needs the whole backward first anyway).
  GradClip clip;
  {
    ProfilePhase phase("optimizer");
    absl::StatusOr<GradClip> clipped = ClipGradients();
    if (!clipped.ok()) {
      optimizer_->ZeroGrad();
      r.status = clipped.status();
      return r;
    }
    clip = *std::move(clipped);
    r.lr = ScheduledLr(options_.optimizer.lr, optimizer_->steps(), options_.schedule);
    optimizer_->Step(r.lr, clip.scale);
    optimizer_->ZeroGrad();
  }
  r.loss = rider->item<double>();  // synchronizes the device
  if (torch::Tensor kl = model_->IndexerLoss(); kl.defined()) {
    // Under context parallelism each rank's is its rows' share: the sum is the sequence's; over
    // data-parallel replicas, the mean of their batches'.
    std::vector<torch::Tensor> shares = {kl.to(torch::kCPU, torch::kFloat64).reshape({1})};
    absl::Status s;
    if (ContextParallelDegree() > 1) s = options_.context_parallel.group->AllReduce(shares, ReduceOp::kSum);
    if (s.ok() && DataParallel()) s = comm_->AllReduce(shares, ReduceOp::kAvg);
    if (!s.ok()) {
      r.status = s;
      return r;
    }
    r.indexer_loss = shares[0].item<double>();
  }
  r.grad_norm = clip.norm.item<double>();
  r.step = optimizer_->steps();
  r.tokens = share->positions;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.tokens_per_second = r.seconds > 0 ? static_cast<double>(r.tokens) / r.seconds : 0;
  if (aux_loss_.defined()) r.aux_loss = aux_loss_.item<double>();
  r.expert_tokens = model::MoeExpertTokens(model::MoeLayers(*model_));
  return r;
}

StepResult Trainer::TrainStep() { return Step(data_->Next()); }

double Trainer::EvalLoss(const Batch& whole) {
  optimizer_->Finish();
  torch::NoGradGuard no_grad;
  model_->eval();
  int64_t targets = 0;
  const torch::Tensor mean = Loss(LocalShard(whole), &targets);  // () over this rank's targets
  if (shards_) shards_->ReleaseAll();  // no backward follows
  if (!cp_gradients_) return mean.item<double>();
  // The shards' sums and counts over the group: the whole batch's mean on every rank.
  std::vector<torch::Tensor> sums = {
      torch::stack({mean.to(torch::kCPU, torch::kFloat64) * static_cast<double>(std::max<int64_t>(1, targets)),
                    torch::tensor(static_cast<double>(targets), torch::kFloat64)})};  // (2,)
  absl::Status s = options_.context_parallel.group->AllReduce(sums, ReduceOp::kSum);
  TORCH_CHECK(s.ok(), "eval loss: context-parallel all-reduce failed: ", s.ToString());
  return sums[0][0].item<double>() / std::max(1.0, sums[0][1].item<double>());
}

absl::Status Trainer::ValidateRl(const std::vector<Datum>& batch, const LossSpec* loss, const RlShard& shard,
                                bool allow_empty) const {
  if (!std::isfinite(shard.weight_sum) || shard.weight_sum < 0)
    return absl::InvalidArgumentError(absl::StrCat("shard.weight_sum (", shard.weight_sum,
                                                   ") must be finite and >= 0 (0: the batch's own sum)"));
  if (shard.datum_offset < 0)
    return absl::InvalidArgumentError(absl::StrCat("shard.datum_offset (", shard.datum_offset, ") must be >= 0"));
  const model::ModelConfig& config = model_->config();
  return ValidateDatums(batch, loss, config.vocab_size, config.max_position_embeddings, shard.datum_offset,
                        allow_empty);
}

absl::Status Trainer::PrepareRlMemory(const std::vector<Datum>& batch) {
  // The host pool (offload) must hold the largest group's padded rows (this rank's positions of
  // them under context parallelism).
  const int64_t P = ContextParallelDegree();
  int64_t positions = 0;
  for (const auto& [begin, end] : RlGroups(batch)) {
    int64_t longest = 0;
    for (size_t i = begin; i < end; ++i) longest = std::max<int64_t>(longest, static_cast<int64_t>(batch[i].tokens.size()));
    positions = std::max<int64_t>(positions, (longest + P - 1) / P * static_cast<int64_t>(end - begin));
  }
  if (positions == 0) return absl::OkStatus();  // nothing runs
  return memory_->Prepare(1, positions, model_->config().hidden_size, dtype_);
}

void Trainer::DropRlGradients() {
  optimizer_->ZeroGrad();
  memory_->attention_stash()->Clear();
  rl_grads_pending_ = false;
}

std::vector<std::pair<size_t, size_t>> Trainer::RlGroups(const std::vector<Datum>& batch) const {
  const int64_t budget = options_.rl_group_tokens > 0 ? options_.rl_group_tokens
                                                      : options_.data.batch_size * options_.data.seq_len;
  std::vector<std::pair<size_t, size_t>> groups;
  if (batch.empty()) return groups;
  size_t begin = 0;
  int64_t longest = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const int64_t S = static_cast<int64_t>(batch[i].tokens.size());
    const int64_t grown = std::max(longest, S) * static_cast<int64_t>(i - begin + 1);
    if (i > begin && grown > budget) {
      groups.emplace_back(begin, i);
      begin = i;
      longest = S;
    } else {
      longest = std::max(longest, S);
    }
  }
  groups.emplace_back(begin, batch.size());
  return groups;
}

Trainer::RlGroupRun Trainer::GroupLogprobs(const std::vector<Datum>& batch, size_t begin, size_t end) {
  const int64_t R = static_cast<int64_t>(end - begin);
  const int64_t P = ContextParallelDegree();
  int64_t S = 0;
  for (size_t i = begin; i < end; ++i) S = std::max<int64_t>(S, static_cast<int64_t>(batch[i].tokens.size()));
  // Every rank the same number of positions; for the hybrid family's DSA layers whole pools of 4
  // on each rank (model/hybrid.h).
  const int64_t granule = P > 1 && model_->config().NumLayersOfKind('D') > 0 ? 4 * P : P;
  S = (S + granule - 1) / granule * granule;
  // Right padding with id 0: causal attention keeps it out of the real positions, and its
  // logprobs are cut off below.
  torch::Tensor ids = torch::zeros({R, S}, torch::kInt64);      // (R, S)
  torch::Tensor targets = torch::zeros({R, S}, torch::kInt64);  // (R, S)
  for (int64_t r = 0; r < R; ++r) {
    const Datum& d = batch[begin + static_cast<size_t>(r)];
    const int64_t n = static_cast<int64_t>(d.tokens.size());
    ids[r].slice(0, 0, n).copy_(torch::tensor(torch::ArrayRef<int64_t>(d.tokens), torch::kInt64));
    targets[r].slice(0, 0, n).copy_(torch::tensor(torch::ArrayRef<int64_t>(d.target_tokens), torch::kInt64));
  }
  RlGroupRun run;
  run.width = S / P;
  run.first = P > 1 ? options_.context_parallel.group->rank() * run.width : 0;
  model::ForwardInputs in;
  in.input_ids = ids.narrow(1, run.first, run.width).to(device_);  // (R, S/P)
  // A shard's RoPE positions are global (the whole-row default only when there is one shard).
  if (P > 1)
    in.position_ids = torch::arange(run.first, run.first + run.width, torch::kInt64).unsqueeze(0).expand({R, run.width})
                          .contiguous()
                          .to(device_);
  const torch::Tensor hidden = Hidden(in);  // (R, S/P, hidden)
  // Tiled when the job's memory plan tiles the loss: no (R, S, vocab) logits at long S.
  const torch::Tensor logp = memory_->TokenLogprobs(hidden, model_->HeadWeight(),
                                                    targets.narrow(1, run.first, run.width).to(device_));  // (R, S/P)
  run.rows = logp.detach();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = static_cast<int64_t>(batch[begin + static_cast<size_t>(r)].tokens.size());
    run.local.push_back(logp[r].slice(0, 0, std::clamp<int64_t>(n - run.first, 0, run.width)));
  }
  return run;
}

std::vector<torch::Tensor> Trainer::WholeLogprobs(const RlGroupRun& run, const std::vector<Datum>& batch,
                                                  size_t begin, size_t end) {
  std::vector<torch::Tensor> out;
  const int64_t P = ContextParallelDegree();
  if (P == 1) {
    for (const torch::Tensor& l : run.local) out.push_back(l.detach());
    return out;
  }
  const int64_t R = static_cast<int64_t>(end - begin);
  absl::StatusOr<torch::Tensor> gathered = options_.context_parallel.group->AllGather(run.rows.contiguous());
  TORCH_CHECK(gathered.ok(), "context-parallel all-gather of the logprobs failed: ", gathered.status().ToString());
  // (P R width,) rank-major -> (R, P width): each row's shards in position order.
  const torch::Tensor rows = gathered->view({P, R, run.width}).permute({1, 0, 2}).reshape({R, P * run.width});
  for (int64_t r = 0; r < R; ++r)
    out.push_back(rows[r].slice(0, 0, static_cast<int64_t>(batch[begin + static_cast<size_t>(r)].tokens.size())));
  return out;
}

namespace {

// The datum's loss inputs at positions [first, first + len) (len 0: empty tensors).
DatumTensors SliceTensors(const DatumTensors& in, int64_t first, int64_t len) {
  auto cut = [&](const torch::Tensor& t) {
    return t.defined() ? t.narrow(0, std::min<int64_t>(first, t.size(0)), len) : t;
  };
  return DatumTensors{cut(in.weights), cut(in.sampler_logprobs), cut(in.advantages)};
}

std::vector<float> ToVector(const torch::Tensor& t) {
  const torch::Tensor cpu = t.detach().to(torch::kCPU, torch::kFloat32).contiguous();  // (S,)
  return std::vector<float>(cpu.data_ptr<float>(), cpu.data_ptr<float>() + cpu.numel());
}

absl::Status ComputeError(const char* call, const c10::Error& e) {
  const std::string what = absl::StrCat(call, " failed; gradients pending since the last optim_step were dropped: ",
                                        e.what_without_backtrace());
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr) return absl::ResourceExhaustedError(what);
  return absl::InternalError(what);
}

}  // namespace

absl::Status Trainer::RunForwardBackward(const std::vector<Datum>& batch, const LossSpec& loss, double W,
                                        ForwardBackwardResult& r) {
  if (batch.empty()) return absl::OkStatus();  // a data-parallel rank with an empty slice
  model_->train();
  try {
    std::vector<torch::Tensor> logps;  // per datum (S,) fp32, detached
    std::vector<DatumTensors> inputs;
    torch::Tensor loss_sum = torch::zeros({}, torch::dtype(torch::kFloat32).device(device_));  // ()
    for (const auto& [begin, end] : RlGroups(batch)) {
      const RlGroupRun run = GroupLogprobs(batch, begin, end);
      // Each datum's term is divided by the whole batch's W (every rank's slice), so the summed
      // gradients are those of the batch loss; the group's backward frees its activations
      // before the next runs. A context-parallel rank's terms cover its positions only.
      torch::Tensor term = torch::zeros({}, torch::dtype(torch::kFloat32).device(device_));  // ()
      for (size_t i = begin; i < end; ++i) {
        DatumTensors in = ToTensors(batch[i], device_);
        const torch::Tensor& local = run.local[i - begin];
        term = term + DatumLossSum(local, SliceTensors(in, run.first, local.size(0)), loss) / W;
        inputs.push_back(std::move(in));
        r.tokens += static_cast<int64_t>(batch[i].tokens.size());
      }
      {
        ProfilePhase phase("backward");
        term.backward();
      }
      loss_sum += term.detach();
      for (torch::Tensor& l : WholeLogprobs(run, batch, begin, end)) logps.push_back(std::move(l));
    }
    if (ContextParallelDegree() > 1) {
      std::vector<torch::Tensor> sums = {loss_sum.to(torch::kCPU, torch::kFloat64).reshape({1})};  // (1,)
      if (absl::Status s = options_.context_parallel.group->AllReduce(sums, ReduceOp::kSum); !s.ok())
        return absl::Status(s.code(), absl::StrCat("forward_backward: the context-parallel loss sum failed: ",
                                                   s.message(), "; the gradients pending since the last optim_step "
                                                   "were dropped"));
      loss_sum = sums[0][0];
    }
    // Metrics after all the compute is queued: the host waits on the device once.
    r.loss = loss_sum.item<double>();
    if (!std::isfinite(r.loss)) {
      // Validated inputs keep every term finite (engine/rl_loss.h), so this is the model: its
      // weights diverged: the session's state, not a fault of the service (FAILED_PRECONDITION,
      // which LoadCheckpoint mends). Gradients that include a non-finite term must not reach
      // OptimStep.
      return absl::FailedPreconditionError(absl::StrCat("forward_backward: the loss is ", r.loss,
                                              " for valid inputs (the weights may have diverged: load a "
                                              "checkpoint); the gradients pending since the last "
                                              "optim_step were dropped"));
    }
    for (size_t i = 0; i < batch.size(); ++i) {
      r.mismatch.Add(logps[i], inputs[i]);
      r.clipped_tokens += PpoClippedTokens(logps[i], inputs[i], loss);
      r.logprobs.push_back(ToVector(logps[i]));
    }
  } catch (const c10::Error& e) {
    return ComputeError("forward_backward", e);
  } catch (const std::exception& e) {
    // Not only torch's errors: a data-parallel rank must reach the collective after this.
    return absl::InternalError(absl::StrCat(
        "forward_backward failed; gradients pending since the last optim_step were dropped: ", e.what()));
  }
  return absl::OkStatus();
}

absl::Status Trainer::SumOverRlRanks(torch::Tensor& flags, torch::Tensor& values) {
  std::vector<torch::Tensor> both = {flags, values};
  if (absl::Status s = comm_->AllReduce(both, ReduceOp::kSum); !s.ok()) return s;
  flags = both[0];
  values = both[1];
  if (ContextParallelDegree() == 1) return absl::OkStatus();
  std::vector<torch::Tensor> group = {flags};
  if (absl::Status s = options_.context_parallel.group->AllReduce(group, ReduceOp::kSum); !s.ok()) return s;
  flags = group[0];
  return absl::OkStatus();
}

absl::StatusOr<double> Trainer::AgreeAcrossRanks(const absl::Status& valid, double value,
                                                 absl::string_view refused_elsewhere) {
  torch::Tensor refused = torch::tensor({valid.ok() ? 0.0 : 1.0}, torch::kFloat64);  // (1,)
  torch::Tensor summed = torch::tensor({value}, torch::kFloat64);                     // (1,)
  if (absl::Status s = SumOverRlRanks(refused, summed); !s.ok()) {
    DropRlGradients();
    return s;
  }
  if (!valid.ok()) return valid;
  if (refused[0].item<double>() > 0) return absl::InvalidArgumentError(refused_elsewhere);
  return summed[0].item<double>();
}

absl::StatusOr<ForwardBackwardResult> Trainer::ForwardBackward(const std::vector<Datum>& batch, const LossSpec& loss,
                                                               const RlShard& shard) {
  const auto t0 = std::chrono::steady_clock::now();
  if (shards_) return absl::UnimplementedError("forward_backward: shard_params is not implemented for RL calls yet");
  // Validation, then every rank learns whether any refused its slice, and the whole batch's W
  // (the sum of the slices' weight sums) when the shard lacks it.
  const absl::Status valid = ValidateRl(batch, &loss, shard, /*allow_empty=*/DataParallel());
  absl::StatusOr<double> summed_w = AgreeAcrossRanks(
      valid, valid.ok() ? BatchWeightSum(batch) : 0.0,
      "batch: refused on another rank (that rank's reply names the datum and the rule); nothing ran on any rank");
  if (!summed_w.ok()) return summed_w.status();
  ForwardBackwardResult r;
  // Every rank sees the same all-reduced sum (the data-parallel slices' sums; a context-parallel
  // group's ranks hold the same slice), so they agree on W and on this check.
  r.weight_sum = shard.weight_sum > 0 ? shard.weight_sum : *summed_w;
  if (!(r.weight_sum > 0))
    return absl::InvalidArgumentError("batch: the weights sum to 0 over the batch; at least one token needs weight > 0");

  absl::Status computed = PrepareRlMemory(batch);
  const bool ran = computed.ok() && !batch.empty();  // this rank's gradients may have changed
  if (ran) computed = RunForwardBackward(batch, loss, r.weight_sum, r);
  // Every rank learns whether any failed, and whether any ran: gradients are kept only where
  // all succeeded, so a later OptimStep never sums a partial batch; where nothing ran anywhere
  // (the host pool could not be prepared) the pending gradients are still whole and stay.
  torch::Tensor outcome = torch::tensor({computed.ok() ? 0.0 : 1.0, ran ? 1.0 : 0.0}, torch::kFloat64);  // (2,)
  torch::Tensor unused = torch::zeros({1}, torch::kFloat64);
  if (absl::Status s = SumOverRlRanks(outcome, unused); !s.ok()) {
    DropRlGradients();
    return s;
  }
  const bool any_failed = outcome[0].item<double>() > 0;
  const bool any_ran = outcome[1].item<double>() > 0;
  if (any_failed && any_ran) DropRlGradients();
  if (!computed.ok()) return computed;
  if (any_failed) {
    if (!any_ran)
      return absl::InternalError(
          "forward_backward failed on another rank; nothing ran on any rank, the gradients pending since the last "
          "optim_step were kept");
    return absl::InternalError(
        "forward_backward failed on another rank; the gradients pending since the last optim_step were dropped on "
        "every rank");
  }
  if (ran) rl_grads_pending_ = true;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

absl::StatusOr<OptimStepResult> Trainer::ApplyPendingGradients(const AdamWOptions& adam) {
  OptimStepResult r;
  const GradClip clip = GradClipScale(params_, options_.grad_clip);
  r.grad_norm = clip.norm.item<double>();  // checked before anything is updated
  rl_grads_pending_ = false;
  if (!std::isfinite(r.grad_norm)) {
    optimizer_->ZeroGrad();
    return absl::InternalError(absl::StrCat("optim_step: the gradient norm is ", r.grad_norm,
                                            "; the update was skipped and the gradients dropped"));
  }
  optimizer_->set_hyperparameters(adam);
  {
    ProfilePhase phase("optimizer");
    optimizer_->Step(adam.lr, clip.scale);
  }
  optimizer_->ZeroGrad();
  r.step = optimizer_->steps();
  r.lr = adam.lr;
  return r;
}

absl::StatusOr<OptimStepResult> Trainer::OptimStep(const AdamWOptions& adam) {
  if (shards_) return absl::UnimplementedError("optim_step: shard_params is not implemented for RL calls yet");
  // Every rank learns whether any refused `adam`, and how many ranks have pending gradients.
  absl::StatusOr<double> ranks_with_grads = AgreeAcrossRanks(
      adam.Validate(), rl_grads_pending_ ? 1.0 : 0.0,
      "optim_step: refused on another rank (invalid AdamW hyperparameters there); nothing was updated");
  if (!ranks_with_grads.ok()) return ranks_with_grads.status();
  if (*ranks_with_grads == 0)
    return absl::FailedPreconditionError(absl::StrCat("optim_step: no gradients since the last optim_step",
                                                      DataParallel() ? " on any rank" : "",
                                                      "; call forward_backward first"));
  // Gradients summed over the ranks (each already divided by the whole batch's W; a rank
  // without any contributes zeros, a parameter no rank has one for stays without): over the
  // context-parallel group first (each rank's positions), then the data-parallel ranks.
  std::vector<torch::Tensor> no_riders;
  if (cp_gradients_)
    if (absl::Status s = cp_gradients_->Reduce(no_riders); !s.ok()) {
      DropRlGradients();
      return s;
    }
  if (absl::Status s = gradients_->Reduce(no_riders); !s.ok()) {
    DropRlGradients();
    return s;
  }
  // The same reduced gradients on every rank: the same norm, the same clip and update (or the
  // same non-finite error everywhere).
  return ApplyPendingGradients(adam);
}

absl::StatusOr<std::vector<std::vector<float>>> Trainer::Forward(const std::vector<Datum>& batch,
                                                                 const RlShard& shard) {
  if (shards_) return absl::UnimplementedError("forward: shard_params is not implemented for RL calls yet");
  if (absl::Status s = ValidateRl(batch, nullptr, shard, /*allow_empty=*/DataParallel()); !s.ok()) return s;
  std::vector<std::vector<float>> out;
  if (batch.empty()) return out;
  if (absl::Status s = PrepareRlMemory(batch); !s.ok()) return s;
  torch::NoGradGuard no_grad;
  model_->eval();
  try {
    std::vector<torch::Tensor> logps;  // per datum (S,) fp32
    for (const auto& [begin, end] : RlGroups(batch)) {
      for (torch::Tensor& l : WholeLogprobs(GroupLogprobs(batch, begin, end), batch, begin, end))
        logps.push_back(std::move(l));
    }
    for (const torch::Tensor& l : logps) out.push_back(ToVector(l));
  } catch (const c10::Error& e) {
    const std::string what = absl::StrCat("forward failed: ", e.what_without_backtrace());
    if (dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr) return absl::ResourceExhaustedError(what);
    return absl::InternalError(what);
  }
  return out;
}

absl::Status Trainer::SaveCheckpoint(const std::string& dir) {
  if (shards_) return SaveShardedCheckpoint(dir);
  optimizer_->Finish();  // the weights written are the updated ones
  return WriteCheckpointFiles(dir, optimizer_->StateTensors());
}

absl::Status Trainer::WriteCheckpointFiles(const std::string& dir,
                                           const std::vector<std::pair<std::string, torch::Tensor>>& optimizer_state) {
  model::SaveOptions save;
  save.dtype = dtype_;
  save.base_dir = options_.model;  // its tokenizer files, when a folder
  const std::filesystem::path root(dir);
  if (model_->lora().enabled()) {
    if (absl::Status s = model::SaveLoraAdapter(model_, dir, dtype_, options_.model); !s.ok()) return s;
    if (absl::Status s = WriteFileAtomically((root / "config.json").string(),
                                             model::ToHfConfigJson(model_->config(), model::DtypeName(dtype_)));
        !s.ok())
      return s;
    if (absl::Status s = model::CopyModelFolderFiles(options_.model, dir); !s.ok()) return s;
    if (options_.lora.merge)
      if (absl::Status s = model::SaveHfCheckpoint(model_, (root / "merged").string(), save); !s.ok()) return s;
  } else if (absl::Status s = model::SaveHfCheckpoint(model_, dir, save); !s.ok()) {
    return s;
  }
  if (absl::Status s = model::WriteSafetensors((root / "optimizer.safetensors").string(), optimizer_state);
      !s.ok())
    return s;
  nlohmann::json state = {{"step", optimizer_->steps()}, {"model", options_.model}, {"seed", options_.seed}};
  return WriteFileAtomically((root / "trainer_state.json").string(), state.dump(2) + "\n");
}

absl::Status Trainer::LoadCheckpoint(const std::string& dir) {
  // The optimizer state is the indexer stage's own (the warm-up's covers the indexers alone):
  // refused before anything is dropped or replaced.
  const model::ModelConfig& config = model_->config();
  if (config.IsHybrid() && config.NumLayersOfKind('D') > 0) {
    absl::StatusOr<model::ModelConfig> saved = model::LoadHfConfig(dir);
    if (saved.ok() && saved->hybrid.indexer_stage != config.hybrid.indexer_stage)
      return absl::FailedPreconditionError(absl::StrCat(
          dir, ": the checkpoint trained the ", model::IndexerStageName(saved->hybrid.indexer_stage),
          " indexer stage and this trainer trains ", model::IndexerStageName(config.hybrid.indexer_stage),
          "; its optimizer state is that stage's: start the new stage from the checkpoint's weights (as the "
          "model) with a fresh optimizer"));
  }
  // Gradients pending from an RL forward_backward belong to the weights being replaced: an
  // optim_step after the load must not apply them. An update in flight must not overwrite the
  // loaded weights.
  optimizer_->Finish();
  optimizer_->ZeroGrad();
  rl_grads_pending_ = false;
  if (shards_) {
    // The whole weights from the files, then this rank's slices of them (any world size saved it).
    // (LoRA with sharding is refused at Create.)
    absl::Status loaded = shards_->GatherAll();
    if (loaded.ok()) loaded = model::LoadHfWeights(model_, dir);
    if (loaded.ok()) shards_->ShardWholeParameters();
    shards_->ReleaseAll();
    if (!loaded.ok()) return loaded;
  } else if (absl::Status s = model_->lora().enabled() ? model::LoadLoraAdapter(model_, dir)
                                                       : model::LoadHfWeights(model_, dir);
             !s.ok()) {
    // A LoRA job's checkpoint holds its adapters; the frozen base stays as loaded.
    return s;
  }
  const std::string opt_path = (std::filesystem::path(dir) / "optimizer.safetensors").string();
  absl::StatusOr<std::unique_ptr<model::SafetensorsFile>> file = model::SafetensorsFile::Open(opt_path);
  if (!file.ok()) return file.status();
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  for (const auto& [name, info] : (*file)->tensors()) {
    absl::StatusOr<torch::Tensor> t = (*file)->Read(name);
    if (!t.ok()) return t.status();
    tensors.emplace_back(name, t->to(device_));
  }
  if (shards_) {
    // "exp_avg.<param>", "exp_avg_sq.<param>", "master.<param>": whole in the file, cut to this
    // rank's shard ("step" as it is).
    for (auto& [name, t] : tensors) {
      const size_t dot = name.find('.');
      if (dot == std::string::npos) continue;
      absl::StatusOr<torch::Tensor> mine = shards_->ShardOf(name.substr(dot + 1), t);
      if (!mine.ok())
        return absl::InvalidArgumentError(absl::StrCat(opt_path, ": ", name, ": ", mine.status().message()));
      t = *std::move(mine);
    }
  }
  return optimizer_->LoadStateTensors(tensors);
}

}  // namespace odyssey::engine

// ---------------------------------------------------------------------------------------------
// Parameter sharding (engine/parallel/sharding.h).

namespace odyssey::engine {

std::vector<int64_t> Trainer::UnitParams(int64_t u) const {
  const int64_t L = static_cast<int64_t>(layer_params_.size());
  if (u == 0) return embed_params_;
  if (u == L + 1) return tail_params_;
  return layer_params_.at(static_cast<size_t>(u - 1));
}

void Trainer::GatherUnit(int64_t u) {
  optimizer_->WaitParams(UnitParams(u));  // a host update of the shards must land first
  shards_->Gather(u);
}

void Trainer::PrefetchUnit(int64_t u) {
  optimizer_->WaitParams(UnitParams(u));
  shards_->Prefetch(u);
}

absl::Status Trainer::ShardParameters(Communicator& group) {
  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (auto& p : model_->named_parameters()) named.emplace_back(p.key(), p.value());
  const int64_t L = static_cast<int64_t>(layer_params_.size());
  std::vector<std::vector<int64_t>> units;
  for (int64_t u = 0; u < L + 2; ++u) units.push_back(UnitParams(u));
  absl::StatusOr<std::unique_ptr<ShardedParameters>> shards = ShardedParameters::Create(group, named, units);
  if (!shards.ok()) return shards.status();
  shards_ = *std::move(shards);
  // The optimizer's index i is parameter i's shard: the host optimizer's per-layer seams
  // (WaitParams, GradsReady) keep their meaning.
  optimizer_ = std::make_unique<AdamW>(shards_->NamedShards(), options_.optimizer, options_.memory.optimizer_on_host,
                                       HostOptionsOf(options_));
  return absl::OkStatus();
}

absl::StatusOr<GradClip> Trainer::ClipGradients() {
  if (shards_) return shards_->ClipScale(options_.grad_clip);
  return GradClipScale(params_, options_.grad_clip, optimizer_->ReleasedGradSquares());
}

absl::Status Trainer::SaveShardedCheckpoint(const std::string& dir) {
  optimizer_->Finish();  // the shards written are the updated ones
  // Every rank gathers (collectives in the same order everywhere); rank 0 of the group writes the
  // files an unsharded run writes.
  std::vector<std::pair<std::string, torch::Tensor>> state;
  for (const auto& [name, t] : optimizer_->StateTensors()) {
    const size_t dot = name.find('.');  // "exp_avg.<param>" ...; "step" is whole already
    if (dot == std::string::npos) {
      state.emplace_back(name, t);
      continue;
    }
    absl::StatusOr<torch::Tensor> whole = shards_->GatherWhole(name.substr(dot + 1), t);
    if (!whole.ok()) return whole.status();
    state.emplace_back(name, *std::move(whole));
  }
  absl::Status written = shards_->GatherAll();
  if (written.ok() && shards_->group().rank() == 0) written = WriteCheckpointFiles(dir, state);
  shards_->ReleaseAll();
  return written;
}

}  // namespace odyssey::engine
