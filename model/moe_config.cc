#include "model/moe_config.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace odyssey::model {
namespace {

using nlohmann::json;

absl::Status ReadInt(const json& j, const char* key, const std::string& source, bool required, int64_t* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (required) return absl::InvalidArgumentError(absl::StrCat(source, ": missing field '", key, "'"));
    return absl::OkStatus();
  }
  if (!it->is_number_integer())
    return absl::InvalidArgumentError(absl::StrCat(source, ": field '", key, "' must be an integer"));
  *out = it->get<int64_t>();
  return absl::OkStatus();
}

absl::Status ReadBool(const json& j, const char* key, const std::string& source, bool* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_boolean())
    return absl::InvalidArgumentError(absl::StrCat(source, ": field '", key, "' must be true or false"));
  *out = it->get<bool>();
  return absl::OkStatus();
}

}  // namespace

bool MoeConfig::IsMoeLayer(int64_t layer) const {
  if (!enabled() || decoder_sparse_step <= 0) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end()) return false;
  return (layer + 1) % decoder_sparse_step == 0;
}

int64_t MoeConfig::LayerParameters(int64_t hidden_size) const {
  int64_t n = num_experts * hidden_size + num_experts * 3 * hidden_size * moe_intermediate_size;
  if (shared_expert_intermediate_size > 0) n += 3 * hidden_size * shared_expert_intermediate_size + hidden_size;
  return n;
}

absl::Status MoeConfig::Validate(int64_t num_hidden_layers) const {
  auto bad = [](const char* field, int64_t v, const char* rule) {
    return absl::InvalidArgumentError(absl::StrCat(field, " (", v, ") ", rule));
  };
  if (num_experts < 0) return bad("num_experts", num_experts, "must be >= 0 (0: a dense model)");
  if (!enabled()) return absl::OkStatus();
  if (num_experts > 32767) return bad("num_experts", num_experts, "must be <= 32767");
  if (num_experts_per_tok < 1 || num_experts_per_tok > num_experts)
    return absl::InvalidArgumentError(absl::StrCat("num_experts_per_tok (", num_experts_per_tok,
                                                   ") must be in [1, num_experts (", num_experts, ")]"));
  if (moe_intermediate_size <= 0) return bad("moe_intermediate_size", moe_intermediate_size, "must be > 0");
  if (decoder_sparse_step <= 0) return bad("decoder_sparse_step", decoder_sparse_step, "must be > 0");
  for (int64_t l : mlp_only_layers) {
    if (l < 0 || l >= num_hidden_layers)
      return absl::InvalidArgumentError(absl::StrCat("mlp_only_layers entry (", l, ") must be in [0, num_hidden_layers (",
                                                     num_hidden_layers, "))"));
  }
  if (shared_expert_intermediate_size < 0)
    return bad("shared_expert_intermediate_size", shared_expert_intermediate_size, "must be >= 0 (0: none)");
  if (!(router_aux_loss_coef >= 0) || !std::isfinite(router_aux_loss_coef))
    return absl::InvalidArgumentError(
        absl::StrCat("router_aux_loss_coef (", router_aux_loss_coef, ") must be finite and >= 0"));
  return absl::OkStatus();
}

absl::Status ParseHfMoeFields(const json& j, const std::string& source, SharedExpert shared, MoeConfig* out) {
  MoeConfig m;
  if (absl::Status s = ReadInt(j, "num_experts", source, true, &m.num_experts); !s.ok()) return s;
  if (absl::Status s = ReadInt(j, "num_experts_per_tok", source, true, &m.num_experts_per_tok); !s.ok()) return s;
  if (absl::Status s = ReadInt(j, "moe_intermediate_size", source, true, &m.moe_intermediate_size); !s.ok()) return s;
  if (absl::Status s = ReadBool(j, "norm_topk_prob", source, &m.norm_topk_prob); !s.ok()) return s;
  if (absl::Status s = ReadInt(j, "decoder_sparse_step", source, false, &m.decoder_sparse_step); !s.ok()) return s;
  if (absl::Status s = ReadBool(j, "output_router_logits", source, &m.output_router_logits); !s.ok()) return s;
  if (auto it = j.find("router_aux_loss_coef"); it != j.end() && !it->is_null()) {
    if (!it->is_number())
      return absl::InvalidArgumentError(absl::StrCat(source, ": field 'router_aux_loss_coef' must be a number"));
    m.router_aux_loss_coef = it->get<double>();
  }
  if (auto it = j.find("mlp_only_layers"); it != j.end() && !it->is_null()) {
    if (!it->is_array())
      return absl::InvalidArgumentError(absl::StrCat(source, ": field 'mlp_only_layers' must be a list of layer indices"));
    for (const auto& v : *it) {
      if (!v.is_number_integer())
        return absl::InvalidArgumentError(absl::StrCat(source, ": mlp_only_layers entry ", v.dump().substr(0, 64),
                                                       " must be an integer"));
      m.mlp_only_layers.push_back(v.get<int64_t>());
    }
  }
  if (shared == SharedExpert::kRequired) {
    bool qkv_bias = true;
    if (absl::Status s = ReadBool(j, "qkv_bias", source, &qkv_bias); !s.ok()) return s;
    if (!qkv_bias)
      return absl::InvalidArgumentError(absl::StrCat(source, ": qkv_bias false is not supported: qwen2_moe attention has "
                                                     "q/k/v biases (true)"));
    if (absl::Status s = ReadInt(j, "shared_expert_intermediate_size", source, true, &m.shared_expert_intermediate_size);
        !s.ok())
      return s;
    if (m.shared_expert_intermediate_size <= 0)
      return absl::InvalidArgumentError(absl::StrCat(source, ": shared_expert_intermediate_size (",
                                                     m.shared_expert_intermediate_size,
                                                     ") must be > 0: every Qwen2-MoE layer has a shared expert"));
  } else if (shared == SharedExpert::kOptional) {
    if (absl::Status s = ReadInt(j, "shared_expert_intermediate_size", source, false, &m.shared_expert_intermediate_size);
        !s.ok())
      return s;
  } else if (auto it = j.find("shared_expert_intermediate_size");
             it != j.end() && it->is_number() && it->get<double>() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": shared_expert_intermediate_size (", it->dump(),
                                                   ") is not supported for this model_type: it has no shared expert "
                                                   "(qwen2_moe has one)"));
  }
  if (m.num_experts <= 0)
    return absl::InvalidArgumentError(absl::StrCat(source, ": num_experts (", m.num_experts,
                                                   ") must be > 0 for an MoE model (its other MoE fields are read)"));
  *out = m;
  return absl::OkStatus();
}

void WriteHfMoeFields(const MoeConfig& m, json* j) {
  (*j)["num_experts"] = m.num_experts;
  (*j)["num_experts_per_tok"] = m.num_experts_per_tok;
  (*j)["moe_intermediate_size"] = m.moe_intermediate_size;
  (*j)["norm_topk_prob"] = m.norm_topk_prob;
  (*j)["decoder_sparse_step"] = m.decoder_sparse_step;
  (*j)["mlp_only_layers"] = m.mlp_only_layers;
  (*j)["router_aux_loss_coef"] = m.router_aux_loss_coef;
  (*j)["output_router_logits"] = m.output_router_logits;
  if (m.shared_expert_intermediate_size > 0)
    (*j)["shared_expert_intermediate_size"] = m.shared_expert_intermediate_size;
}

const std::vector<std::string>& HfMoeFieldNames() {
  static const std::vector<std::string> names = {
      "num_experts",          "num_experts_per_tok",  "moe_intermediate_size",
      "norm_topk_prob",       "decoder_sparse_step",  "mlp_only_layers",
      "router_aux_loss_coef", "output_router_logits", "shared_expert_intermediate_size"};
  return names;
}

}  // namespace odyssey::model
