#include "planner/memory_spec.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"

namespace odyssey::planner {

absl::StatusOr<MemoryFields> MemoryFieldsFromProto(const v1::MemorySpec& m, absl::string_view prefix) {
  auto invalid = [&](absl::string_view field, const std::string& rule) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, ".", field, ": ", rule));
  };
  MemoryFields f;
  if (!m.recompute().empty()) {
    absl::StatusOr<Recompute> r = ParseRecompute(m.recompute());
    if (!r.ok()) return invalid("recompute", absl::StrCat("'", m.recompute(), "' is not one of none, layer, every_k"));
    f.recompute = *r;
  }
  if (m.recompute_every_k() < 0 || m.recompute_every_k() == 1)
    return invalid("recompute_every_k", absl::StrCat("(", m.recompute_every_k(), ") must be >= 2 (or 0: unset)"));
  if (f.recompute == Recompute::kEveryK && m.recompute_every_k() == 0)
    return invalid("recompute_every_k",
                   absl::StrCat("(", m.recompute_every_k(), ") must be > 0 when memory.recompute is \"every_k\""));
  if (m.recompute_every_k() > 0) f.every_k = m.recompute_every_k();
  if (m.offload() == "on") {
    f.offload = true;
  } else if (m.offload() == "off") {
    f.offload = false;
  } else if (!m.offload().empty() && m.offload() != "auto") {
    return invalid("offload", absl::StrCat("('", m.offload(), "') must be on, off, auto or empty"));
  }
  if (m.mlp_tile_tokens() < 0)
    return invalid("mlp_tile_tokens", absl::StrCat("(", m.mlp_tile_tokens(), ") must be >= 0 (0: unset)"));
  if (m.mlp_tile_tokens() > 0) f.mlp_tile = m.mlp_tile_tokens();
  if (m.loss_tile_tokens() < 0)
    return invalid("loss_tile_tokens", absl::StrCat("(", m.loss_tile_tokens(), ") must be >= 0 (0: unset)"));
  if (m.loss_tile_tokens() > 0) f.loss_tile = m.loss_tile_tokens();
  if (m.host_budget_bytes() < 0)
    return invalid("host_budget_bytes", absl::StrCat("(", m.host_budget_bytes(), ") must be >= 0 (0: the worker's limit)"));
  f.host_budget_bytes = m.host_budget_bytes();
  if (m.has_device_resident()) {
    if (m.device_resident() < 0)
      return invalid("device_resident", absl::StrCat("(", m.device_resident(), ") must be >= 0"));
    if (f.offload == false)
      return invalid("device_resident", "is set but memory.offload is \"off\": it counts offloaded inputs kept on the GPU");
    f.device_resident = m.device_resident();
  }
  if (m.attention_head_groups() < 0)
    return invalid("attention_head_groups", absl::StrCat("(", m.attention_head_groups(), ") must be >= 0 (0: unset)"));
  if (m.attention_head_groups() > 0) f.head_groups = m.attention_head_groups();
  if (m.has_keep_attention()) {
    if (m.keep_attention() && f.recompute && *f.recompute != Recompute::kLayer)
      return invalid("keep_attention", absl::StrCat("needs memory.recompute \"layer\" (it is \"", m.recompute(), "\")"));
    f.keep_attention = m.keep_attention();
  }
  if (m.has_optimizer_on_host()) f.optimizer_on_host = m.optimizer_on_host();
  if (m.has_keep_selection()) {
    if (m.keep_selection() && f.recompute == Recompute::kNone)
      return invalid("keep_selection", "needs memory.recompute \"layer\" or \"every_k\": the selections are kept for "
                                       "the recompute");
    f.keep_selection = m.keep_selection();
  }
  if (m.has_bf16_moments()) {
    if (m.bf16_moments() && f.optimizer_on_host == false)
      return invalid("bf16_moments", "needs memory.optimizer_on_host: the device optimizer keeps fp32 moments");
    f.bf16_moments = m.bf16_moments();
  }
  if (f.offload == true && f.recompute == Recompute::kNone)
    return invalid("offload", "\"on\" needs memory.recompute \"layer\" or \"every_k\": it offloads the checkpointed inputs");
  return f;
}

void MemoryStrategyToProto(const MemoryStrategy& s, v1::MemorySpec* m) {
  m->set_recompute(std::string(RecomputeName(s.recompute)));
  m->set_recompute_every_k(static_cast<int32_t>(s.every_k));
  m->set_offload(s.offload ? "on" : "off");
  m->set_mlp_tile_tokens(s.mlp_tile);
  m->set_loss_tile_tokens(s.loss_tile);
  m->set_host_budget_bytes(s.host_budget_bytes);
  m->set_device_resident(s.device_resident);
  m->set_attention_head_groups(static_cast<int32_t>(s.head_groups));
  m->set_keep_attention(s.keep_attention);
  m->set_optimizer_on_host(s.optimizer_on_host);
  m->set_keep_selection(s.keep_selection);
  m->set_bf16_moments(s.bf16_moments);
}

Hardware MachineHardware(int64_t device_memory_bytes, int64_t host_memory_bytes, int64_t spec_host_budget_bytes) {
  Hardware h;
  h.gpu_bytes = UsableGpuBytes(device_memory_bytes);
  h.host_bytes = HostBudget(host_memory_bytes, spec_host_budget_bytes);
  return h;
}

int64_t ShardRanks(const v1::JobSpec& spec) {
  return spec.parallel().shard_params() ? std::max<int64_t>(1, spec.parallel().world_size()) : 1;
}

int64_t RankSeqLen(const v1::JobSpec& spec) {
  const int64_t cp = std::max<int64_t>(1, spec.parallel().context_parallel());
  return (spec.data().seq_len() + cp - 1) / cp;
}

absl::StatusOr<model::LoraConfig> LoraFromProto(const v1::LoraSpec& spec, absl::string_view prefix) {
  model::LoraConfig c;
  c.rank = spec.rank();
  c.alpha = spec.alpha();
  c.dropout = spec.dropout();
  c.target_modules.assign(spec.target_modules().begin(), spec.target_modules().end());
  c.merge = spec.merge();
  if (absl::Status s = c.Validate(std::string(prefix)); !s.ok()) return s;
  return c;
}

absl::StatusOr<model::ModelConfig> SpecModelConfig(const v1::JobSpec& spec) {
  absl::StatusOr<model::ModelConfig> config = model::ResolveModelConfig(spec.model().name());
  if (!config.ok()) return absl::InvalidArgumentError(absl::StrCat("spec.model.name: ", config.status().message()));
  if (absl::Status s = model::SetIndexerStage("spec.model.indexer_stage", spec.model().indexer_stage(), &*config);
      !s.ok())
    return s;
  return config;
}

absl::StatusOr<JobPlan> PlanJobSpec(const v1::JobSpec& spec, const Hardware& hardware) {
  absl::StatusOr<model::ModelConfig> config = SpecModelConfig(spec);
  if (!config.ok()) return config.status();
  return PlanJobSpec(spec, *config, hardware);
}

absl::StatusOr<JobPlan> PlanJobSpec(const v1::JobSpec& spec, const model::ModelConfig& config,
                                    const Hardware& hardware) {
  absl::StatusOr<MemoryFields> fields = MemoryFieldsFromProto(spec.memory());
  if (!fields.ok()) return fields.status();
  absl::StatusOr<model::LoraConfig> lora = LoraFromProto(spec.lora());
  if (!lora.ok()) return lora.status();
  return PlanModelJob(config, spec.model().dtype(), RankSeqLen(spec), spec.data().batch_size(), *fields, hardware,
                      *lora, ShardRanks(spec), std::max<int64_t>(1, spec.parallel().context_parallel()),
                      GradientsToStep(spec.kind() == v1::RL_SESSION, spec.parallel().context_parallel()));
}

}  // namespace odyssey::planner
