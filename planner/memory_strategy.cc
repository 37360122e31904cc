#include "planner/memory_strategy.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace odyssey::planner {

absl::string_view RecomputeName(Recompute r) {
  switch (r) {
    case Recompute::kNone:
      return "none";
    case Recompute::kLayer:
      return "layer";
    case Recompute::kEveryK:
      return "every_k";
  }
  return "none";
}

absl::StatusOr<Recompute> ParseRecompute(absl::string_view name, absl::string_view field) {
  for (Recompute r : {Recompute::kNone, Recompute::kLayer, Recompute::kEveryK}) {
    if (name == RecomputeName(r)) return r;
  }
  return absl::InvalidArgumentError(absl::StrCat(field, " '", name, "' is not one of none, layer, every_k"));
}

absl::Status MemoryStrategy::Validate() const {
  if (recompute == Recompute::kEveryK && every_k < 2)
    return absl::InvalidArgumentError(absl::StrCat("memory.every_k (", every_k, ") must be >= 2"));
  if (offload && recompute == Recompute::kNone)
    return absl::InvalidArgumentError(
        "memory.offload needs memory.recompute 'layer' or 'every_k': it offloads the checkpointed inputs");
  if (device_resident < 0)
    return absl::InvalidArgumentError(absl::StrCat("memory.device_resident (", device_resident, ") must be >= 0"));
  if (device_resident > 0 && !offload)
    return absl::InvalidArgumentError(absl::StrCat("memory.device_resident (", device_resident,
                                                   ") needs memory.offload on: it counts offloaded inputs kept on "
                                                   "the GPU"));
  if (mlp_tile < 0) return absl::InvalidArgumentError(absl::StrCat("memory.mlp_tile (", mlp_tile, ") must be >= 0"));
  if (loss_tile < 0) return absl::InvalidArgumentError(absl::StrCat("memory.loss_tile (", loss_tile, ") must be >= 0"));
  if (head_groups < 1)
    return absl::InvalidArgumentError(absl::StrCat("memory.head_groups (", head_groups, ") must be >= 1"));
  if (keep_attention && recompute != Recompute::kLayer)
    return absl::InvalidArgumentError("memory.keep_attention needs memory.recompute 'layer'");
  if (keep_selection && recompute == Recompute::kNone)
    return absl::InvalidArgumentError(
        "memory.keep_selection needs memory.recompute 'layer' or 'every_k': the selections are kept for the recompute");
  if (host_budget_bytes < 0)
    return absl::InvalidArgumentError(absl::StrCat("memory.host_budget_bytes (", host_budget_bytes, ") must be >= 0"));
  if (bf16_moments && !optimizer_on_host)
    return absl::InvalidArgumentError(
        "memory.bf16_moments needs memory.optimizer_on_host: the device optimizer keeps fp32 moments");
  return absl::OkStatus();
}

absl::Status MemoryStrategy::ValidateForModel(int64_t num_layers, int64_t num_key_value_heads) const {
  if (absl::Status s = Validate(); !s.ok()) return s;
  if (num_key_value_heads > 0 && num_key_value_heads % head_groups != 0)
    return absl::InvalidArgumentError(absl::StrCat("memory.head_groups (", head_groups,
                                                   ") must divide the model's num_key_value_heads (",
                                                   num_key_value_heads, ")"));
  if (recompute == Recompute::kEveryK && num_layers > 0 && every_k > num_layers)
    return absl::InvalidArgumentError(absl::StrCat("memory.every_k (", every_k, ") must be <= the model's layers (",
                                                   num_layers, ")"));
  return absl::OkStatus();
}

std::string MemoryStrategy::Describe() const {
  std::string s = absl::StrCat("recompute=", RecomputeName(recompute));
  if (recompute == Recompute::kEveryK) absl::StrAppend(&s, "(k=", every_k, ")");
  absl::StrAppend(&s, " offload=", offload ? "on" : "off");
  if (offload) absl::StrAppend(&s, "(device_resident=", device_resident, ")");
  absl::StrAppend(&s, " mlp_tile=", mlp_tile, " loss_tile=", loss_tile, " head_groups=", head_groups);
  if (optimizer_on_host) absl::StrAppend(&s, " optimizer_on_host");
  if (keep_attention) absl::StrAppend(&s, " keep_attention");
  if (keep_selection) absl::StrAppend(&s, " keep_selection");
  if (bf16_moments) absl::StrAppend(&s, " bf16_moments");
  return s;
}

int64_t MemoryStrategy::NumCheckpoints(int64_t num_layers) const {
  switch (recompute) {
    case Recompute::kNone:
      return 0;
    case Recompute::kLayer:
      return num_layers;
    case Recompute::kEveryK:
      return (num_layers + every_k - 1) / every_k;
  }
  return 0;
}

bool MemoryFields::AllSet() const {
  return recompute && every_k && offload && device_resident && mlp_tile && loss_tile && head_groups &&
         keep_attention && optimizer_on_host && keep_selection && bf16_moments;
}

bool MemoryFields::AnySet() const {
  return recompute || every_k || offload || device_resident || mlp_tile || loss_tile || head_groups ||
         keep_attention || optimizer_on_host || keep_selection || bf16_moments;
}

MemoryStrategy MemoryFields::ApplyTo(MemoryStrategy s) const {
  if (recompute) s.recompute = *recompute;
  if (every_k) s.every_k = *every_k;
  if (offload) s.offload = *offload;
  if (device_resident) s.device_resident = *device_resident;
  if (mlp_tile) s.mlp_tile = *mlp_tile;
  if (loss_tile) s.loss_tile = *loss_tile;
  if (head_groups) s.head_groups = *head_groups;
  if (keep_attention) s.keep_attention = *keep_attention;
  if (optimizer_on_host) s.optimizer_on_host = *optimizer_on_host;
  if (keep_selection) s.keep_selection = *keep_selection;
  if (bf16_moments) s.bf16_moments = *bf16_moments;
  if (host_budget_bytes > 0) s.host_budget_bytes = host_budget_bytes;
  // A choice that the spec's fields made meaningless is dropped, not kept to fail validation:
  // a chosen offload with the spec's recompute "none", a chosen kept attention with the spec's
  // nested groups. What the spec set itself stays (and Validate() says why it cannot run).
  if (!offload && s.recompute == Recompute::kNone) s.offload = false;
  if (!keep_attention && s.recompute != Recompute::kLayer) s.keep_attention = false;
  if (!keep_selection && s.recompute == Recompute::kNone) s.keep_selection = false;
  if (!bf16_moments && !s.optimizer_on_host) s.bf16_moments = false;
  if (!s.offload && !device_resident) s.device_resident = 0;
  return s;
}

int64_t HostBudget(int64_t host_memory_bytes, int64_t spec_budget_bytes) {
  if (spec_budget_bytes > 0) return spec_budget_bytes;
  return host_memory_bytes / 100 * 85;
}

int64_t UsableGpuBytes(int64_t device_memory_bytes) { return device_memory_bytes - (int64_t{3} << 30); }

int64_t UsableCpuBytes(int64_t host_memory_bytes, int64_t spec_budget_bytes) {
  return std::max<int64_t>(0, HostBudget(host_memory_bytes, spec_budget_bytes) - kCpuProcessBytes);
}

}  // namespace odyssey::planner
