// The Mixture-of-Experts settings of a decoder model (the dense family's Qwen3-MoE and Qwen2-MoE,
// or a hybrid model's MLPs): which layers have a routed-experts MLP instead of the dense one, how
// tokens are routed, the optional shared expert and the auxiliary load-balancing loss. Plain data
// without libtorch, part of ModelConfig (model/config.h), so the planner and the controller see
// it. model/moe.h computes it.
// Thread safety: a value type; no shared state.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "nlohmann/json_fwd.hpp"

namespace odyssey::model {

struct MoeConfig {
  // 0: a dense model (every other field is ignored). Otherwise the number of routed experts.
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;    // k of the top-k routing; 1 <= k <= num_experts.
  int64_t moe_intermediate_size = 0;  // each routed expert's SwiGLU width.
  // Renormalize the k selected router probabilities to sum to 1 (Qwen3-MoE: true).
  bool norm_topk_prob = false;
  // Layer i is an MoE layer when (i + 1) % decoder_sparse_step == 0 and i is not in
  // mlp_only_layers (transformers' rule); the others keep the dense MLP.
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  // The load-balancing loss coef * num_experts * sum_e f_e * P_e (f_e: the fraction of routing
  // slots, over every MoE layer's tokens, that chose expert e; P_e: its mean router probability)
  // is added to the training loss when output_router_logits is true, as transformers does.
  double router_aux_loss_coef = 0.001;
  bool output_router_logits = false;
  // > 0: one shared expert of this width on every token, its output scaled by
  // sigmoid(shared_expert_gate(x)) (Qwen2-MoE). 0: none (Qwen3-MoE).
  int64_t shared_expert_intermediate_size = 0;

  bool enabled() const { return num_experts > 0; }
  // Whether decoder layer `layer` (0-based) has the MoE MLP.
  bool IsMoeLayer(int64_t layer) const;
  // Parameters of one MoE MLP (router, experts, shared expert and its gate).
  int64_t LayerParameters(int64_t hidden_size) const;
  // Checks every field (only num_experts >= 0 when disabled); the message names the field and
  // the rule.
  absl::Status Validate(int64_t num_hidden_layers) const;
};

// Whether a model type has the shared expert (shared_expert_intermediate_size).
enum class SharedExpert {
  kNone,      // qwen3_moe: refused when > 0
  kRequired,  // qwen2_moe: every MoE layer has one
  kOptional,  // odyssey_hybrid: 0 (absent) or > 0
};

// Reads the MoE fields of a config.json object (`model_type` qwen3_moe or qwen2_moe, or
// odyssey_hybrid with an MoE MLP; `shared` says what the shared-expert field may be). Errors name
// the field, prefixed by `source`.
absl::Status ParseHfMoeFields(const nlohmann::json& j, const std::string& source, SharedExpert shared,
                              MoeConfig* out);
// Writes the fields ParseHfMoeFields (and transformers) read back into `j`.
void WriteHfMoeFields(const MoeConfig& moe, nlohmann::json* j);
// The config.json keys of the MoE fields (what WriteHfMoeFields may write).
const std::vector<std::string>& HfMoeFieldNames();

}  // namespace odyssey::model
