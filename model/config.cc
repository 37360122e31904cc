#include "model/config.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/files.h"
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

int64_t ModelConfig::NumParameters() const {
  const int64_t d = HeadDim();
  int64_t attn = hidden_size * num_attention_heads * d * 2 + hidden_size * num_key_value_heads * d * 2;
  if (QkvBias()) attn += (num_attention_heads + 2 * num_key_value_heads) * d;
  if (OBias()) attn += hidden_size;
  if (QkNorm()) attn += 2 * d;
  int64_t mlp = 3 * hidden_size * intermediate_size;
  if (mlp_bias) mlp += 2 * intermediate_size + hidden_size;
  const int64_t layer = attn + mlp + 2 * hidden_size;
  const int64_t emb = vocab_size * hidden_size * (tie_word_embeddings ? 1 : 2);
  return num_hidden_layers * layer + emb + hidden_size;
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
  return absl::OkStatus();
}

absl::StatusOr<ModelConfig> ParseHfConfig(const std::string& text, const std::string& source) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    return absl::InvalidArgumentError(absl::StrCat(source, ": not a JSON object"));
  ModelConfig c;
  const std::string model_type = j.value("model_type", std::string());
  if (model_type == "llama") {
    c.architecture = Architecture::kLlama;
  } else if (model_type == "qwen2") {
    c.architecture = Architecture::kQwen2;
  } else if (model_type == "qwen3") {
    c.architecture = Architecture::kQwen3;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(source, ": model_type '", model_type,
                                                   "' is not supported (llama, qwen2, qwen3)"));
  }
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
  const char* type = c.architecture == Architecture::kLlama   ? "llama"
                     : c.architecture == Architecture::kQwen2 ? "qwen2"
                                                               : "qwen3";
  const char* arch = c.architecture == Architecture::kLlama   ? "LlamaForCausalLM"
                     : c.architecture == Architecture::kQwen2 ? "Qwen2ForCausalLM"
                                                               : "Qwen3ForCausalLM";
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

std::vector<std::string> NamedShapeNames() { return {"tiny", "llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b"}; }

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

}  // namespace odyssey::model
