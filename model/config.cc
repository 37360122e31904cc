#include "model/config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/files.h"
#include "common/wire_text.h"
#include "nlohmann/json.hpp"

namespace odyssey::model {
namespace {

using nlohmann::json;

absl::Status Positive(const char* field, int64_t v) {
  if (v <= 0) return absl::InvalidArgumentError(absl::StrCat(field, " (", v, ") must be > 0"));
  return absl::OkStatus();
}

// Reads an integer field; absent keeps `*out`, a wrong type is an error naming the field.
absl::Status GetInt(const json& j, const char* key, int64_t* out, const std::string& source,
                    bool required) {
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

absl::Status GetDouble(const json& j, const char* key, double* out, const std::string& source) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_number()) return absl::InvalidArgumentError(absl::StrCat(source, ": field '", key, "' must be a number"));
  *out = it->get<double>();
  return absl::OkStatus();
}

absl::Status GetBool(const json& j, const char* key, bool* out, const std::string& source) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_boolean()) return absl::InvalidArgumentError(absl::StrCat(source, ": field '", key, "' must be true or false"));
  *out = it->get<bool>();
  return absl::OkStatus();
}

#define RETURN_IF_ERROR_CFG(expr)            \
  do {                                       \
    absl::Status _s = (expr);                \
    if (!_s.ok()) return _s;                 \
  } while (0)

}  // namespace

char ModelConfig::LayerKind(int64_t i) const {
  if (!IsHybrid() || hybrid.layer_pattern.empty()) return 'A';
  return hybrid.layer_pattern[static_cast<size_t>(i) % hybrid.layer_pattern.size()];
}

int64_t ModelConfig::NumLayersOfKind(char kind) const {
  int64_t n = 0;
  for (int64_t i = 0; i < num_hidden_layers; ++i) n += LayerKind(i) == kind ? 1 : 0;
  return n;
}

std::string ModelConfig::HeadGroupsRefusal(int64_t head_groups, int64_t context_parallel) const {
  if (head_groups <= 1 || !IsHybrid()) return "";
  if (NumLayersOfKind('D') == 0)
    return " acts on the DSA layers of the hybrid family (their KV heads); this model has none";
  if (context_parallel > 1)
    return absl::StrCat(" is not implemented for the hybrid family with context parallelism (", context_parallel,
                        " ranks), whose ranks split the DSA layers' heads already");
  return "";
}

absl::StatusOr<IndexerStage> ParseIndexerStage(const std::string& name) {
  if (name == "dense_warmup") return IndexerStage::kDenseWarmup;
  if (name == "sparse") return IndexerStage::kSparse;
  return absl::InvalidArgumentError(
      absl::StrCat("indexer_stage '", name, "' is not one of dense_warmup, sparse"));
}

const char* IndexerStageName(IndexerStage stage) {
  return stage == IndexerStage::kDenseWarmup ? "dense_warmup" : "sparse";
}

namespace {
absl::Status ValidateHybrid(const ModelConfig& c);
}  // namespace

int64_t ModelConfig::NumParameters() const {
  // MoE layers swap the dense MLP (`mlp` parameters) for the router, the experts and the shared
  // expert.
  auto moe_delta = [this](int64_t mlp) {
    int64_t delta = 0;
    for (int64_t i = 0; i < num_hidden_layers; ++i)
      if (moe.IsMoeLayer(i)) delta += moe.LayerParameters(hidden_size) - mlp;
    return delta;
  };
  if (IsHybrid()) {
    const int64_t h = hidden_size, d = HeadDim(), Hq = num_attention_heads, Hkv = num_key_value_heads;
    const int64_t Hk = hybrid.kda_num_heads, K = hybrid.kda_head_dim, HK = Hk * K;
    // q, k, v, o projections, three short convs, the gate's low-rank pair, A_log, dt_bias, b_proj,
    // the output gate's low-rank pair, the per-head output norm.
    const int64_t kda = 4 * h * HK + 3 * HK * hybrid.kda_conv_kernel + (h * K + K * HK) + Hk + HK + h * Hk +
                        (h * K + K * HK) + K;
    // q, k, v, o; the indexer.
    const int64_t dsa = 2 * h * Hq * d + 2 * h * Hkv * d + IndexerParameters() / std::max<int64_t>(1, NumLayersOfKind('D'));
    const int64_t common = 3 * h * intermediate_size + 2 * h;
    const int64_t emb = vocab_size * h * (tie_word_embeddings ? 1 : 2);
    return NumLayersOfKind('K') * (kda + common) + NumLayersOfKind('D') * (dsa + common) + emb + h +
           moe_delta(3 * h * intermediate_size);
  }
  const int64_t d = HeadDim();
  int64_t attn = hidden_size * num_attention_heads * d * 2 + hidden_size * num_key_value_heads * d * 2;
  if (QkvBias()) attn += (num_attention_heads + 2 * num_key_value_heads) * d;
  if (OBias()) attn += hidden_size;
  if (QkNorm()) attn += 2 * d;
  int64_t mlp = 3 * hidden_size * intermediate_size;
  if (mlp_bias) mlp += 2 * intermediate_size + hidden_size;
  const int64_t layer = attn + mlp + 2 * hidden_size;
  const int64_t emb = vocab_size * hidden_size * (tie_word_embeddings ? 1 : 2);
  return num_hidden_layers * layer + emb + hidden_size + moe_delta(mlp);
}

int64_t ModelConfig::IndexerParameters() const {
  if (!IsHybrid()) return 0;
  const int64_t h = hidden_size, HI = hybrid.index_num_heads, DI = hybrid.index_head_dim;
  // wq, wk, k_norm (weight, bias), weights_proj, the pool gate and the pool bias.
  return NumLayersOfKind('D') * (h * HI * DI + h * DI + 2 * DI + h * HI + h * DI + 4 * DI);
}

absl::Status ModelConfig::Validate() const {
  RETURN_IF_ERROR_CFG(Positive("vocab_size", vocab_size));
  RETURN_IF_ERROR_CFG(Positive("hidden_size", hidden_size));
  RETURN_IF_ERROR_CFG(Positive("intermediate_size", intermediate_size));
  RETURN_IF_ERROR_CFG(Positive("num_hidden_layers", num_hidden_layers));
  RETURN_IF_ERROR_CFG(Positive("num_attention_heads", num_attention_heads));
  RETURN_IF_ERROR_CFG(Positive("num_key_value_heads", num_key_value_heads));
  RETURN_IF_ERROR_CFG(Positive("max_position_embeddings", max_position_embeddings));
  if (num_attention_heads % num_key_value_heads != 0)
    return absl::InvalidArgumentError(absl::StrCat("num_key_value_heads (", num_key_value_heads,
                                                   ") must divide num_attention_heads (", num_attention_heads, ")"));
  if (head_dim < 0) return absl::InvalidArgumentError(absl::StrCat("head_dim (", head_dim, ") must be >= 0"));
  if (head_dim == 0 && hidden_size % num_attention_heads != 0)
    return absl::InvalidArgumentError(absl::StrCat("num_attention_heads (", num_attention_heads,
                                                   ") must divide hidden_size (", hidden_size,
                                                   ") when head_dim is not given"));
  if (IsHybrid()) return ValidateHybrid(*this);
  if (HeadDim() % 2 != 0)
    return absl::InvalidArgumentError(absl::StrCat("head_dim (", HeadDim(), ") must be even for RoPE"));
  if (!(rms_norm_eps > 0)) return absl::InvalidArgumentError("rms_norm_eps must be > 0");
  if (!(rope_theta > 0)) return absl::InvalidArgumentError("rope_theta must be > 0");
  if (rope_scaling.enabled) {
    if (!(rope_scaling.factor >= 1)) return absl::InvalidArgumentError("rope_scaling.factor must be >= 1");
    if (!(rope_scaling.high_freq_factor > rope_scaling.low_freq_factor))
      return absl::InvalidArgumentError("rope_scaling.high_freq_factor must be > rope_scaling.low_freq_factor");
    RETURN_IF_ERROR_CFG(Positive("rope_scaling.original_max_position_embeddings",
                                 rope_scaling.original_max_position_embeddings));
  }
  RETURN_IF_ERROR_CFG(moe.Validate(num_hidden_layers));
  if (moe.enabled()) {
    if (architecture == Architecture::kLlama)
      return absl::InvalidArgumentError(absl::StrCat("num_experts (", moe.num_experts,
                                                     ") must be 0 for llama: MoE needs the qwen3 (qwen3_moe), qwen2 "
                                                     "(qwen2_moe) or hybrid (odyssey_hybrid) architecture"));
    if ((architecture == Architecture::kQwen2) != (moe.shared_expert_intermediate_size > 0))
      return absl::InvalidArgumentError(absl::StrCat(
          "shared_expert_intermediate_size (", moe.shared_expert_intermediate_size,
          ") must be > 0 exactly for qwen2 (qwen2_moe has a shared expert, qwen3_moe none)"));
  }
  return absl::OkStatus();
}

namespace {

// The hybrid family's rules (Validate() after the fields both families share).
absl::Status ValidateHybrid(const ModelConfig& c) {
  const HybridConfig& y = c.hybrid;
  const double rms_norm_eps = c.rms_norm_eps;
  const bool attention_bias = c.attention_bias, mlp_bias = c.mlp_bias;
  const int64_t num_hidden_layers = c.num_hidden_layers;
  if (!(rms_norm_eps > 0)) return absl::InvalidArgumentError("rms_norm_eps must be > 0");
  if (attention_bias || mlp_bias)
    return absl::InvalidArgumentError("attention_bias and mlp_bias must be false in the hybrid family");
  if (y.layer_pattern.empty())
    return absl::InvalidArgumentError("layer_pattern must not be empty (one letter per layer: K for KDA, D for DSA)");
  for (char ch : y.layer_pattern) {
    if (ch != 'K' && ch != 'D')
      return absl::InvalidArgumentError(absl::StrCat("layer_pattern '", y.layer_pattern, "' has '",
                                                     std::string(1, ch), "': only K (KDA) and D (DSA) are layers"));
  }
  const int64_t n = static_cast<int64_t>(y.layer_pattern.size());
  if (num_hidden_layers % n != 0)
    return absl::InvalidArgumentError(absl::StrCat("num_hidden_layers (", num_hidden_layers,
                                                   ") must be a multiple of the length of layer_pattern '",
                                                   y.layer_pattern, "' (", n, ")"));
  if (c.NumLayersOfKind('K') > 0) {
    RETURN_IF_ERROR_CFG(Positive("kda_num_heads", y.kda_num_heads));
    RETURN_IF_ERROR_CFG(Positive("kda_head_dim", y.kda_head_dim));
    RETURN_IF_ERROR_CFG(Positive("kda_conv_kernel", y.kda_conv_kernel));
    if (y.kda_chunk_size != 32 && y.kda_chunk_size != 64)
      return absl::InvalidArgumentError(absl::StrCat("kda_chunk_size (", y.kda_chunk_size, ") must be 32 or 64"));
    if (!(y.kda_gate_lower_bound < 0) || !std::isfinite(y.kda_gate_lower_bound))
      return absl::InvalidArgumentError(absl::StrCat("kda_gate_lower_bound (", y.kda_gate_lower_bound,
                                                     ") must be finite and < 0"));
  }
  if (c.NumLayersOfKind('D') > 0) {
    RETURN_IF_ERROR_CFG(Positive("index_num_heads", y.index_num_heads));
    RETURN_IF_ERROR_CFG(Positive("index_head_dim", y.index_head_dim));
    if (y.index_top_k < 4 || y.index_top_k % 4 != 0)
      return absl::InvalidArgumentError(absl::StrCat("index_top_k (", y.index_top_k,
                                                     ") must be a positive multiple of 4 (pools of 4 keys)"));
    if (!(y.indexer_loss_weight >= 0) || !std::isfinite(y.indexer_loss_weight))
      return absl::InvalidArgumentError(absl::StrCat("indexer_loss_weight (", y.indexer_loss_weight,
                                                     ") must be finite and >= 0"));
  }
  // The MLP of any layer may be the experts, with or without a shared expert.
  RETURN_IF_ERROR_CFG(c.moe.Validate(num_hidden_layers));
  return absl::OkStatus();
}

// Every key a hybrid config.json may have besides the MoE fields (HfMoeFieldNames; ToHfConfigJson
// writes them all): anything else is refused by name, so a field meant to change the math is
// never silently ignored.
const std::vector<std::string>& HybridKeys() {
  static const std::vector<std::string> keys = {
      "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
      "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
      "hidden_act", "tie_word_embeddings", "torch_dtype", "bos_token_id", "eos_token_id", "layer_pattern",
      "kda_num_heads", "kda_head_dim", "kda_conv_kernel", "kda_chunk_size", "kda_gate_lower_bound",
      "index_num_heads", "index_head_dim", "index_top_k", "indexer_loss_weight", "indexer_stage"};
  return keys;
}

absl::StatusOr<ModelConfig> ParseHybridConfig(const json& j, const std::string& source) {
  // Other models' names for the experts: refused by name, pointing at the names read here.
  for (const char* moe : {"n_routed_experts", "n_shared_experts", "num_local_experts"}) {
    if (j.contains(moe))
      return absl::InvalidArgumentError(absl::StrCat(source, ": ", moe,
                                                     " is not supported: the hybrid family's MoE fields are ",
                                                     absl::StrJoin(HfMoeFieldNames(), ", ")));
  }
  bool has_moe = false;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const auto& keys = HybridKeys();
    const auto& moe_keys = HfMoeFieldNames();
    if (std::find(moe_keys.begin(), moe_keys.end(), it.key()) != moe_keys.end()) {
      has_moe = true;
      continue;
    }
    if (std::find(keys.begin(), keys.end(), it.key()) == keys.end())
      return absl::InvalidArgumentError(absl::StrCat(source, ": field '", it.key(),
                                                     "' is not a field of the odyssey_hybrid config (",
                                                     absl::StrJoin(keys, ", "), ", and the MoE fields ",
                                                     absl::StrJoin(moe_keys, ", "), ")"));
  }
  if (auto it = j.find("hidden_act"); it != j.end() && !(it->is_string() && it->get<std::string>() == "silu"))
    return absl::InvalidArgumentError(absl::StrCat(source, ": hidden_act ", it->dump(),
                                                   " is not supported: the MLP is SwiGLU (silu)"));
  ModelConfig c;
  c.architecture = Architecture::kHybrid;
  if (has_moe) RETURN_IF_ERROR_CFG(ParseHfMoeFields(j, source, SharedExpert::kOptional, &c.moe));
  HybridConfig& y = c.hybrid;
  RETURN_IF_ERROR_CFG(GetInt(j, "vocab_size", &c.vocab_size, source, true));
  RETURN_IF_ERROR_CFG(GetInt(j, "hidden_size", &c.hidden_size, source, true));
  RETURN_IF_ERROR_CFG(GetInt(j, "intermediate_size", &c.intermediate_size, source, true));
  RETURN_IF_ERROR_CFG(GetInt(j, "num_hidden_layers", &c.num_hidden_layers, source, true));
  RETURN_IF_ERROR_CFG(GetInt(j, "num_attention_heads", &c.num_attention_heads, source, true));
  RETURN_IF_ERROR_CFG(GetInt(j, "num_key_value_heads", &c.num_key_value_heads, source, true));
  RETURN_IF_ERROR_CFG(GetInt(j, "head_dim", &c.head_dim, source, false));
  c.max_position_embeddings = 4096;
  RETURN_IF_ERROR_CFG(GetInt(j, "max_position_embeddings", &c.max_position_embeddings, source, false));
  RETURN_IF_ERROR_CFG(GetDouble(j, "rms_norm_eps", &c.rms_norm_eps, source));
  RETURN_IF_ERROR_CFG(GetBool(j, "tie_word_embeddings", &c.tie_word_embeddings, source));
  RETURN_IF_ERROR_CFG(GetInt(j, "bos_token_id", &c.bos_token_id, source, false));
  RETURN_IF_ERROR_CFG(GetInt(j, "eos_token_id", &c.eos_token_id, source, false));
  if (auto it = j.find("layer_pattern"); it == j.end() || !it->is_string()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": field 'layer_pattern' must be a string of K and D"));
  } else {
    y.layer_pattern = it->get<std::string>();
  }
  RETURN_IF_ERROR_CFG(GetInt(j, "kda_num_heads", &y.kda_num_heads, source, false));
  RETURN_IF_ERROR_CFG(GetInt(j, "kda_head_dim", &y.kda_head_dim, source, false));
  RETURN_IF_ERROR_CFG(GetInt(j, "kda_conv_kernel", &y.kda_conv_kernel, source, false));
  RETURN_IF_ERROR_CFG(GetInt(j, "kda_chunk_size", &y.kda_chunk_size, source, false));
  RETURN_IF_ERROR_CFG(GetDouble(j, "kda_gate_lower_bound", &y.kda_gate_lower_bound, source));
  RETURN_IF_ERROR_CFG(GetInt(j, "index_num_heads", &y.index_num_heads, source, false));
  RETURN_IF_ERROR_CFG(GetInt(j, "index_head_dim", &y.index_head_dim, source, false));
  RETURN_IF_ERROR_CFG(GetInt(j, "index_top_k", &y.index_top_k, source, false));
  RETURN_IF_ERROR_CFG(GetDouble(j, "indexer_loss_weight", &y.indexer_loss_weight, source));
  if (auto it = j.find("indexer_stage"); it != j.end()) {
    if (!it->is_string())
      return absl::InvalidArgumentError(absl::StrCat(source, ": field 'indexer_stage' must be dense_warmup or sparse"));
    absl::StatusOr<IndexerStage> stage = ParseIndexerStage(it->get<std::string>());
    if (!stage.ok()) return absl::InvalidArgumentError(absl::StrCat(source, ": ", stage.status().message()));
    y.indexer_stage = *stage;
  }
  if (absl::Status s = c.Validate(); !s.ok()) return absl::InvalidArgumentError(absl::StrCat(source, ": ", s.message()));
  return c;
}

}  // namespace

absl::StatusOr<ModelConfig> ParseHfConfig(const std::string& text, const std::string& source) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    return absl::InvalidArgumentError(absl::StrCat(source, ": not a JSON object"));
  ModelConfig c;
  const std::string model_type = j.value("model_type", std::string());
  if (model_type == "odyssey_hybrid") return ParseHybridConfig(j, source);
  if (model_type == "llama") {
    c.architecture = Architecture::kLlama;
  } else if (model_type == "qwen2") {
    c.architecture = Architecture::kQwen2;
  } else if (model_type == "qwen3" || model_type == "qwen3_moe") {
    c.architecture = Architecture::kQwen3;
  } else if (model_type == "qwen2_moe") {
    c.architecture = Architecture::kQwen2;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": model_type '", WireText(model_type, 64),
                     "' is not supported (llama, qwen2, qwen3, qwen2_moe, qwen3_moe, odyssey_hybrid)"));
  }
  if (model_type == "qwen3_moe" || model_type == "qwen2_moe")
    RETURN_IF_ERROR_CFG(ParseHfMoeFields(
        j, source, model_type == "qwen2_moe" ? SharedExpert::kRequired : SharedExpert::kNone, &c.moe));
  // Accepted means computed: a field whose value changes the math of a layer this model does not
  // implement is refused, naming the field, its value and what is supported, rather than loaded
  // and computed as something else.
  for (const char* act_key : {"hidden_act", "hidden_activation"}) {
    if (auto it = j.find(act_key); it != j.end() && !it->is_null()) {
      const std::string act = it->is_string() ? it->get<std::string>() : it->dump();
      if (act != "silu" && act != "swish")
        return absl::InvalidArgumentError(absl::StrCat(source, ": ", act_key, " '", act,
                                                       "' is not supported: the MLP is SwiGLU (silu)"));
    }
  }
  if (auto it = j.find("use_sliding_window"); it != j.end() && it->is_boolean() && it->get<bool>())
    return absl::InvalidArgumentError(absl::StrCat(source, ": use_sliding_window true is not supported: attention is "
                                                   "full causal (set it false, or use a model without sliding "
                                                   "windows)"));
  if (auto it = j.find("layer_types"); it != j.end() && it->is_array()) {
    for (const auto& t : *it) {
      if (!t.is_string() || t.get<std::string>() != "full_attention")
        return absl::InvalidArgumentError(absl::StrCat(source, ": layer_types entry ", t.dump(),
                                                       " is not supported: every layer is full_attention"));
    }
  }
  if (model_type == "llama") {
    if (auto it = j.find("sliding_window"); it != j.end() && it->is_number())
      return absl::InvalidArgumentError(absl::StrCat(source, ": sliding_window (", it->dump(),
                                                     ") is not supported: attention is full causal"));
  }
  if (auto it = j.find("attention_dropout"); it != j.end() && it->is_number() && it->get<double>() != 0)
    return absl::InvalidArgumentError(absl::StrCat(source, ": attention_dropout (", it->dump(),
                                                   ") is not supported: training runs without dropout (0)"));
  if (auto it = j.find("partial_rotary_factor"); it != j.end() && it->is_number() && it->get<double>() != 1)
    return absl::InvalidArgumentError(absl::StrCat(source, ": partial_rotary_factor (", it->dump(),
                                                   ") is not supported: RoPE rotates the whole head (1)"));
  for (const char* cap : {"attn_logit_softcapping", "final_logit_softcapping"}) {
    if (auto it = j.find(cap); it != j.end() && !it->is_null())
      return absl::InvalidArgumentError(absl::StrCat(source, ": ", cap, " (", it->dump(),
                                                     ") is not supported: logits are not soft-capped (null)"));
  }
  RETURN_IF_ERROR_CFG(GetInt(j, "vocab_size", &c.vocab_size, source, true));
  RETURN_IF_ERROR_CFG(GetInt(j, "hidden_size", &c.hidden_size, source, true));
  RETURN_IF_ERROR_CFG(GetInt(j, "intermediate_size", &c.intermediate_size, source, true));
  RETURN_IF_ERROR_CFG(GetInt(j, "num_hidden_layers", &c.num_hidden_layers, source, true));
  RETURN_IF_ERROR_CFG(GetInt(j, "num_attention_heads", &c.num_attention_heads, source, true));
  c.num_key_value_heads = c.num_attention_heads;
  RETURN_IF_ERROR_CFG(GetInt(j, "num_key_value_heads", &c.num_key_value_heads, source, false));
  RETURN_IF_ERROR_CFG(GetInt(j, "head_dim", &c.head_dim, source, false));
  c.max_position_embeddings = 4096;
  RETURN_IF_ERROR_CFG(GetInt(j, "max_position_embeddings", &c.max_position_embeddings, source, false));
  RETURN_IF_ERROR_CFG(GetDouble(j, "rms_norm_eps", &c.rms_norm_eps, source));
  RETURN_IF_ERROR_CFG(GetDouble(j, "rope_theta", &c.rope_theta, source));
  RETURN_IF_ERROR_CFG(GetBool(j, "tie_word_embeddings", &c.tie_word_embeddings, source));
  RETURN_IF_ERROR_CFG(GetBool(j, "attention_bias", &c.attention_bias, source));
  RETURN_IF_ERROR_CFG(GetBool(j, "mlp_bias", &c.mlp_bias, source));
  if (c.architecture == Architecture::kQwen2) c.attention_bias = false;  // qkv bias is implied.
  RETURN_IF_ERROR_CFG(GetInt(j, "bos_token_id", &c.bos_token_id, source, false));
  if (auto it = j.find("eos_token_id"); it != j.end() && it->is_number_integer()) c.eos_token_id = it->get<int64_t>();
  // transformers 5 nests rope settings under rope_parameters; 4.x uses rope_theta + rope_scaling.
  const json* rope = nullptr;
  if (auto it = j.find("rope_scaling"); it != j.end() && it->is_object()) rope = &*it;
  if (auto it = j.find("rope_parameters"); it != j.end() && it->is_object()) {
    RETURN_IF_ERROR_CFG(GetDouble(*it, "rope_theta", &c.rope_theta, source));
    rope = &*it;
  }
  if (rope != nullptr) {
    std::string type = rope->value("rope_type", rope->value("type", std::string("default")));
    if (type == "llama3") {
      c.rope_scaling.enabled = true;
      RETURN_IF_ERROR_CFG(GetDouble(*rope, "factor", &c.rope_scaling.factor, source));
      RETURN_IF_ERROR_CFG(GetDouble(*rope, "low_freq_factor", &c.rope_scaling.low_freq_factor, source));
      RETURN_IF_ERROR_CFG(GetDouble(*rope, "high_freq_factor", &c.rope_scaling.high_freq_factor, source));
      RETURN_IF_ERROR_CFG(GetInt(*rope, "original_max_position_embeddings",
                                 &c.rope_scaling.original_max_position_embeddings, source, false));
    } else if (type != "default") {
      return absl::InvalidArgumentError(absl::StrCat(source, ": rope_scaling.rope_type '", type,
                                                     "' is not supported (default, llama3)"));
    }
  }
  if (absl::Status s = c.Validate(); !s.ok()) return absl::InvalidArgumentError(absl::StrCat(source, ": ", s.message()));
  return c;
}

absl::StatusOr<ModelConfig> LoadHfConfig(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  // Never blocks (a FIFO is refused), and a config is small.
  absl::StatusOr<std::string> text = ReadRegularFile(path, 16 << 20);
  if (!text.ok()) return text.status();
  return ParseHfConfig(*text, path);
}

std::string ToHfConfigJson(const ModelConfig& c, const std::string& torch_dtype) {
  json j;
  if (c.IsHybrid()) {
    const HybridConfig& y = c.hybrid;
    j["model_type"] = "odyssey_hybrid";
    j["architectures"] = json::array({"OdysseyHybridForCausalLM"});
    j["vocab_size"] = c.vocab_size;
    j["hidden_size"] = c.hidden_size;
    j["intermediate_size"] = c.intermediate_size;
    j["num_hidden_layers"] = c.num_hidden_layers;
    j["num_attention_heads"] = c.num_attention_heads;
    j["num_key_value_heads"] = c.num_key_value_heads;
    j["head_dim"] = c.HeadDim();
    j["max_position_embeddings"] = c.max_position_embeddings;
    j["rms_norm_eps"] = c.rms_norm_eps;
    j["hidden_act"] = "silu";
    j["tie_word_embeddings"] = c.tie_word_embeddings;
    j["torch_dtype"] = torch_dtype;
    j["layer_pattern"] = y.layer_pattern;
    j["kda_num_heads"] = y.kda_num_heads;
    j["kda_head_dim"] = y.kda_head_dim;
    j["kda_conv_kernel"] = y.kda_conv_kernel;
    j["kda_chunk_size"] = y.kda_chunk_size;
    j["kda_gate_lower_bound"] = y.kda_gate_lower_bound;
    j["index_num_heads"] = y.index_num_heads;
    j["index_head_dim"] = y.index_head_dim;
    j["index_top_k"] = y.index_top_k;
    j["indexer_loss_weight"] = y.indexer_loss_weight;
    j["indexer_stage"] = IndexerStageName(y.indexer_stage);
    if (c.bos_token_id >= 0) j["bos_token_id"] = c.bos_token_id;
    if (c.eos_token_id >= 0) j["eos_token_id"] = c.eos_token_id;
    if (c.moe.enabled()) WriteHfMoeFields(c.moe, &j);
    return j.dump(2) + "\n";
  }
  const char* type = c.architecture == Architecture::kLlama   ? "llama"
                     : c.architecture == Architecture::kQwen2 ? "qwen2"
                                                               : "qwen3";
  const char* arch = c.architecture == Architecture::kLlama   ? "LlamaForCausalLM"
                     : c.architecture == Architecture::kQwen2 ? "Qwen2ForCausalLM"
                                                               : "Qwen3ForCausalLM";
  if (c.moe.enabled()) {
    type = c.architecture == Architecture::kQwen2 ? "qwen2_moe" : "qwen3_moe";
    arch = c.architecture == Architecture::kQwen2 ? "Qwen2MoeForCausalLM" : "Qwen3MoeForCausalLM";
    WriteHfMoeFields(c.moe, &j);
  }
  j["model_type"] = type;
  j["architectures"] = json::array({arch});
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.HeadDim();
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope_theta"] = c.rope_theta;
  j["hidden_act"] = "silu";
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["torch_dtype"] = torch_dtype;
  if (c.architecture == Architecture::kLlama) {
    j["attention_bias"] = c.attention_bias;
    j["mlp_bias"] = c.mlp_bias;
  } else if (c.architecture == Architecture::kQwen3) {
    j["attention_bias"] = c.attention_bias;
  }
  if (c.rope_scaling.enabled) {
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", c.rope_scaling.factor},
                         {"low_freq_factor", c.rope_scaling.low_freq_factor},
                         {"high_freq_factor", c.rope_scaling.high_freq_factor},
                         {"original_max_position_embeddings", c.rope_scaling.original_max_position_embeddings}};
  } else {
    j["rope_scaling"] = nullptr;
  }
  if (c.bos_token_id >= 0) j["bos_token_id"] = c.bos_token_id;
  if (c.eos_token_id >= 0) j["eos_token_id"] = c.eos_token_id;
  return j.dump(2) + "\n";
}

namespace {
ModelConfig Llama3(int64_t hidden, int64_t inter, int64_t layers, int64_t heads, int64_t kv, bool tied,
                   double theta, double factor) {
  ModelConfig c;
  c.architecture = Architecture::kLlama;
  c.vocab_size = 128256;
  c.hidden_size = hidden;
  c.intermediate_size = inter;
  c.num_hidden_layers = layers;
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv;
  c.head_dim = 0;  // hidden / heads: 64 for 1B, 128 for 3B and 8B
  // The published configs say 131072; RoPE itself has no limit, and these shapes exist to
  // benchmark long context, so they accept up to 16M positions.
  c.max_position_embeddings = int64_t{1} << 24;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = theta;
  c.rope_scaling = {true, factor, 1.0, 4.0, 8192};
  c.tie_word_embeddings = tied;
  c.bos_token_id = 128000;
  c.eos_token_id = 128001;
  return c;
}
}  // namespace

std::vector<std::string> NamedShapeNames() {
  return {"tiny",        "llama-3.2-1b",   "llama-3.2-3b",    "llama-3.1-8b", "hybrid-tiny",
          "hybrid-3b",   "qwen3-moe-tiny", "hybrid-tiny-moe", "hybrid-3b-moe"};
}

absl::StatusOr<ModelConfig> NamedShape(const std::string& name) {
  if (name == "tiny") {
    // Byte-level model for the embedded default (King James text, CPU): 256 byte tokens.
    ModelConfig c;
    c.architecture = Architecture::kLlama;
    c.vocab_size = 256;
    c.hidden_size = 128;
    c.intermediate_size = 384;
    c.num_hidden_layers = 4;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.max_position_embeddings = 4096;
    c.rms_norm_eps = 1e-5;
    c.rope_theta = 10000.0;
    c.tie_word_embeddings = true;
    return c;
  }
  if (name == "hybrid-tiny") {
    // The tiny model's size with the hybrid layers (tests, CPU): KKKD once, byte tokens; the
    // indexer keeps 4 pools (16 tokens) + the tail, so rows longer than 16 are truly sparse.
    ModelConfig c;
    c.architecture = Architecture::kHybrid;
    c.vocab_size = 256;
    c.hidden_size = 64;
    c.intermediate_size = 192;
    c.num_hidden_layers = 4;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 16;
    c.max_position_embeddings = 4096;
    c.rms_norm_eps = 1e-5;
    c.tie_word_embeddings = true;
    c.hybrid.layer_pattern = "KKKD";
    c.hybrid.kda_num_heads = 4;
    c.hybrid.kda_head_dim = 16;
    c.hybrid.index_num_heads = 2;
    c.hybrid.index_head_dim = 16;
    c.hybrid.index_top_k = 16;
    c.hybrid.indexer_loss_weight = 0.1;
    return c;
  }
  if (name == "hybrid-3b") {
    // d 3072, 28 layers = 7 x KKKD (21 KDA + 7 DSA), NoPE; DSA GQA 24/8 x 128, KDA 24 x 128
    // heads, the indexer 32 heads x 128 over pools of 4 keys, top 2048 keys + tail (spec 2.4).
    ModelConfig c;
    c.architecture = Architecture::kHybrid;
    c.vocab_size = 128256;
    c.hidden_size = 3072;
    c.intermediate_size = 8192;
    c.num_hidden_layers = 28;
    c.num_attention_heads = 24;
    c.num_key_value_heads = 8;
    c.head_dim = 128;
    c.max_position_embeddings = int64_t{1} << 24;
    c.rms_norm_eps = 1e-5;
    c.tie_word_embeddings = true;
    c.bos_token_id = 128000;
    c.eos_token_id = 128001;
    c.hybrid.layer_pattern = "KKKD";
    c.hybrid.kda_num_heads = 24;
    c.hybrid.kda_head_dim = 128;
    c.hybrid.index_num_heads = 32;
    c.hybrid.index_head_dim = 128;
    c.hybrid.index_top_k = 2048;
    c.hybrid.indexer_loss_weight = 1.0;
    return c;
  }
  if (name == "qwen3-moe-tiny") {
    // Byte-level Qwen3-MoE for tests: 8 experts, top-2, every layer sparse, load-balancing on.
    ModelConfig c;
    c.architecture = Architecture::kQwen3;
    c.vocab_size = 256;
    c.hidden_size = 64;
    c.intermediate_size = 128;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 16;
    c.max_position_embeddings = 4096;
    c.rms_norm_eps = 1e-6;
    c.rope_theta = 10000.0;
    c.tie_word_embeddings = true;
    c.moe.num_experts = 8;
    c.moe.num_experts_per_tok = 2;
    c.moe.moe_intermediate_size = 32;
    c.moe.norm_topk_prob = true;
    c.moe.output_router_logits = true;
    c.moe.router_aux_loss_coef = 0.01;
    return c;
  }
  if (name == "hybrid-tiny-moe") {
    // hybrid-tiny with MoE MLPs in every layer (tests, CPU): 8 experts of 32, top-2, a shared
    // expert of 64, load-balancing on.
    ModelConfig c = *NamedShape("hybrid-tiny");
    c.moe.num_experts = 8;
    c.moe.num_experts_per_tok = 2;
    c.moe.moe_intermediate_size = 32;
    c.moe.shared_expert_intermediate_size = 64;
    c.moe.norm_topk_prob = true;
    c.moe.output_router_logits = true;
    c.moe.router_aux_loss_coef = 0.01;
    return c;
  }
  if (name == "hybrid-3b-moe") {
    // hybrid-3b with MoE MLPs in every layer: 16 experts of 2048, top-2, and a shared expert of
    // 4096, so a token's MLP is 2 x 2048 + 4096 = 8192 wide, hybrid-3b's dense width (the same
    // MLP FLOPs per token); the load-balancing loss at Qwen-MoE's default coefficient.
    ModelConfig c = *NamedShape("hybrid-3b");
    c.moe.num_experts = 16;
    c.moe.num_experts_per_tok = 2;
    c.moe.moe_intermediate_size = 2048;
    c.moe.shared_expert_intermediate_size = 4096;
    c.moe.norm_topk_prob = true;
    c.moe.output_router_logits = true;
    c.moe.router_aux_loss_coef = 0.001;
    return c;
  }
  if (name == "llama-3.2-1b") return Llama3(2048, 8192, 16, 32, 8, true, 500000.0, 32.0);
  if (name == "llama-3.2-3b") return Llama3(3072, 8192, 28, 24, 8, true, 500000.0, 32.0);
  if (name == "llama-3.1-8b") return Llama3(4096, 14336, 32, 32, 8, false, 500000.0, 8.0);
  return absl::InvalidArgumentError(absl::StrCat("model '", name, "' is neither a named shape (",
                                                 absl::StrJoin(NamedShapeNames(), ", "),
                                                 ") nor a checkpoint directory with config.json"));
}

absl::StatusOr<ModelConfig> ResolveModelConfig(const std::string& name_or_dir) {
  // The error_code form: a name too long for a path (or with a NUL) is just not a folder.
  std::error_code ec;
  if (std::filesystem::is_directory(name_or_dir, ec)) return LoadHfConfig(name_or_dir);
  return NamedShape(name_or_dir);
}

absl::Status SetIndexerStage(const std::string& field, const std::string& stage, ModelConfig* config) {
  if (stage.empty()) return absl::OkStatus();
  absl::StatusOr<IndexerStage> s = ParseIndexerStage(stage);
  if (!s.ok()) {
    // Only a short value is echoed (error text stays bounded).
    const std::string shown = stage.size() <= 32 ? absl::StrCat("'", absl::CHexEscape(stage), "'")
                                                 : absl::StrCat("(", stage.size(), " bytes)");
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", shown, " is not one of dense_warmup, sparse"));
  }
  if (!config->IsHybrid() || config->NumLayersOfKind('D') == 0)
    return absl::InvalidArgumentError(absl::StrCat(field, " (", stage,
                                                   ") acts on DSA layers' indexers; the model has no DSA layers"));
  config->hybrid.indexer_stage = *s;
  return absl::OkStatus();
}

absl::StatusOr<ModelConfig> ResolveModelConfig(const std::string& name_or_dir, const ModelOverrides& o,
                                               const std::string& field_prefix) {
  absl::StatusOr<ModelConfig> c = ResolveModelConfig(name_or_dir);
  if (!c.ok()) return c.status();
  if (o.num_layers < 0)
    return absl::InvalidArgumentError(absl::StrCat(field_prefix, "num_layers (", o.num_layers, ") must be >= 0"));
  if (o.num_layers > 0) {
    std::error_code ec;
    if (std::filesystem::is_directory(name_or_dir, ec))
      return absl::InvalidArgumentError(absl::StrCat(field_prefix,
                                                     "num_layers can only cut a named shape, not a checkpoint directory"));
    c->num_hidden_layers = o.num_layers;
  }
  if (absl::Status s = SetIndexerStage(field_prefix + "indexer_stage", o.indexer_stage, &*c); !s.ok()) return s;
  if (o.kda_chunk_size != 0) {
    if (c->NumLayersOfKind('K') == 0)
      return absl::InvalidArgumentError(absl::StrCat(field_prefix, "kda_chunk_size: the model has no KDA layers"));
    if (o.kda_chunk_size != 32 && o.kda_chunk_size != 64)
      return absl::InvalidArgumentError(
          absl::StrCat(field_prefix, "kda_chunk_size (", o.kda_chunk_size, ") must be 32 or 64"));
    c->hybrid.kda_chunk_size = o.kda_chunk_size;
  }
  return c;
}

const std::vector<std::string>& LoraTargetNames() {
  static const std::vector<std::string> names = {"q_proj", "k_proj", "v_proj", "o_proj",
                                                 "gate_proj", "up_proj", "down_proj"};
  return names;
}

std::vector<std::string> LoraConfig::Targets() const {
  if (target_modules.empty()) return LoraTargetNames();
  std::vector<std::string> out;
  for (const std::string& name : LoraTargetNames())
    if (std::find(target_modules.begin(), target_modules.end(), name) != target_modules.end()) out.push_back(name);
  return out;
}

namespace {
// (in, out) features of projection `name` of `m`'s layers of kind `kind` (ModelConfig::
// LayerKind: the dense attention and DSA share the attention's shapes; KDA's q, k, v and o are
// its heads' H K wide).
std::pair<int64_t, int64_t> ProjectionDims(const ModelConfig& m, const std::string& name, char kind) {
  const int64_t H = m.hidden_size;
  int64_t q = m.num_attention_heads * m.HeadDim(), kv = m.num_key_value_heads * m.HeadDim();
  if (kind == 'K') q = kv = m.hybrid.kda_num_heads * m.hybrid.kda_head_dim;
  if (name == "q_proj") return {H, q};
  if (name == "k_proj" || name == "v_proj") return {H, kv};
  if (name == "o_proj") return {q, H};
  if (name == "down_proj") return {m.intermediate_size, H};
  return {H, m.intermediate_size};  // gate_proj, up_proj
}
}  // namespace

absl::Status LoraConfig::Validate(const std::string& prefix, const ModelConfig* model) const {
  if (rank < 0 || rank > 1024)
    return absl::InvalidArgumentError(absl::StrCat(prefix, ".rank: (", rank, ") must be in [0, 1024] (0 = no LoRA)"));
  if (rank == 0) {
    if (alpha != 0 || dropout != 0 || !target_modules.empty() || merge)
      return absl::InvalidArgumentError(absl::StrCat(prefix, ".rank: (0) must be > 0 when other ", prefix,
                                                     " fields are set (rank 0 means no LoRA)"));
    return absl::OkStatus();
  }
  if (!std::isfinite(alpha) || alpha < 0)
    return absl::InvalidArgumentError(absl::StrCat(prefix, ".alpha: (", alpha, ") must be >= 0 and finite (0 = rank)"));
  if (dropout != 0)
    return absl::InvalidArgumentError(absl::StrCat(prefix, ".dropout: (", dropout,
                                                   ") must be 0: dropout on the adapters' input is not implemented"));
  for (size_t i = 0; i < target_modules.size(); ++i) {
    const std::string& t = target_modules[i];
    const auto& names = LoraTargetNames();
    if (std::find(names.begin(), names.end(), t) == names.end())
      return absl::InvalidArgumentError(absl::StrCat(prefix, ".target_modules[", i, "]: (\"", WireText(t, 64),
                                                     "\") must be one of ", absl::StrJoin(names, ", ")));
    if (std::find(target_modules.begin(), target_modules.begin() + static_cast<std::ptrdiff_t>(i), t) !=
        target_modules.begin() + static_cast<std::ptrdiff_t>(i))
      return absl::InvalidArgumentError(absl::StrCat(prefix, ".target_modules[", i, "]: (\"", t, "\") is named twice"));
  }
  if (model != nullptr && model->moe.enabled()) {
    return absl::InvalidArgumentError(absl::StrCat(
        prefix, ".rank: (", rank, ") LoRA is not implemented for MoE models yet (num_experts ", model->moe.num_experts,
        "): their experts and router have no adapters (set 0)"));
  }
  if (model != nullptr) {
    for (const std::string& t : Targets()) {
      std::pair<int64_t, int64_t> dims = ProjectionDims(*model, t, 'A');
      for (int64_t i = 0; i < model->num_hidden_layers; ++i) {
        const std::pair<int64_t, int64_t> d = ProjectionDims(*model, t, model->LayerKind(i));
        if (std::min(d.first, d.second) < std::min(dims.first, dims.second)) dims = d;
      }
      auto [in, out] = dims;
      if (rank > std::min(in, out))
        return absl::InvalidArgumentError(absl::StrCat(prefix, ".rank: (", rank, ") must be <= the smaller dim of ", t,
                                                       " (", in, " -> ", out, ")"));
    }
  }
  return absl::OkStatus();
}

int64_t LoraConfig::NumParameters(const ModelConfig& model) const {
  if (!enabled()) return 0;
  int64_t n = 0;
  for (int64_t i = 0; i < model.num_hidden_layers; ++i) {
    for (const std::string& t : Targets()) {
      auto [in, out] = ProjectionDims(model, t, model.LayerKind(i));
      n += rank * (in + out);
    }
  }
  return n;
}

std::string ToPeftAdapterConfigJson(const LoraConfig& lora, const std::string& base_model) {
  json j;
  j["peft_type"] = "LORA";
  j["task_type"] = "CAUSAL_LM";
  j["base_model_name_or_path"] = base_model;
  j["r"] = lora.rank;
  j["lora_alpha"] = lora.alpha > 0 ? lora.alpha : static_cast<double>(lora.rank);
  j["lora_dropout"] = lora.dropout;
  j["target_modules"] = lora.Targets();
  j["bias"] = "none";
  j["fan_in_fan_out"] = false;
  j["use_rslora"] = false;
  j["use_dora"] = false;
  j["inference_mode"] = true;
  j["init_lora_weights"] = true;
  j["modules_to_save"] = nullptr;
  return j.dump(2) + "\n";
}

absl::StatusOr<LoraConfig> ParsePeftAdapterConfig(const std::string& text, const std::string& source) {
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(source, ": not a JSON object"));
  if (!j.contains("peft_type") || j["peft_type"] != "LORA")
    return absl::InvalidArgumentError(absl::StrCat(source, ": peft_type must be \"LORA\""));
  LoraConfig c;
  if (!j.contains("r") || !j["r"].is_number_integer() || j["r"].get<int64_t>() <= 0)
    return absl::InvalidArgumentError(absl::StrCat(source, ": r must be a positive integer"));
  c.rank = j["r"].get<int64_t>();
  if (!j.contains("lora_alpha") || !j["lora_alpha"].is_number())
    return absl::InvalidArgumentError(absl::StrCat(source, ": lora_alpha must be a number"));
  c.alpha = j["lora_alpha"].get<double>();
  if (j.contains("lora_dropout") && j["lora_dropout"].is_number()) c.dropout = j["lora_dropout"].get<double>();
  if (!j.contains("target_modules") || !j["target_modules"].is_array())
    return absl::InvalidArgumentError(absl::StrCat(source, ": target_modules must be a list of module names"));
  for (const json& t : j["target_modules"]) {
    if (!t.is_string()) return absl::InvalidArgumentError(absl::StrCat(source, ": target_modules must hold strings"));
    c.target_modules.push_back(t.get<std::string>());
  }
  if (absl::Status s = c.Validate(source); !s.ok()) return s;
  return c;
}

}  // namespace odyssey::model
