#include "model/weights.h"

#include <filesystem>
#include <set>

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "common/files.h"
#include "model/safetensors.h"
#include "common/log.h"

namespace odyssey::model {

absl::Status LoadHfWeights(CausalLM& model, const std::string& dir) {
  absl::StatusOr<SafetensorsCheckpoint> ckpt = SafetensorsCheckpoint::Open(dir);
  if (!ckpt.ok()) return ckpt.status();
  torch::NoGradGuard no_grad;
  std::set<std::string> used;
  for (auto& p : model->named_parameters()) {
    if (!ckpt->Has(p.key())) {
      return absl::NotFoundError(absl::StrCat("checkpoint ", dir, ": missing tensor '", p.key(),
                                              "' that the model (", model->config().num_hidden_layers,
                                              " layers) needs"));
    }
    if (absl::Status s = ckpt->ReadInto(p.key(), p.value()); !s.ok()) return s;
    used.insert(p.key());
  }
  int unused = 0;
  for (const std::string& name : ckpt->Names()) {
    if (!used.count(name) && !(name == "lm_head.weight" && model->config().tie_word_embeddings)) ++unused;
  }
  if (unused > 0) LogWarning(absl::StrCat("checkpoint ", dir, ": ", unused, " tensors not used by the model were ignored"));
  return absl::OkStatus();
}

absl::StatusOr<CausalLM> LoadPretrained(const std::string& dir, torch::Dtype dtype, torch::Device device) {
  absl::StatusOr<ModelConfig> config = LoadHfConfig(dir);
  if (!config.ok()) return config.status();
  absl::StatusOr<CausalLM> model = MakeCausalLM(*config);
  if (!model.ok()) return model.status();
  (*model)->to(device, dtype);
  if (absl::Status s = LoadHfWeights(*model, dir); !s.ok()) return s;
  return model;
}

absl::StatusOr<CausalLM> LoadModel(const std::string& name_or_dir, torch::Dtype dtype, torch::Device device,
                                   uint64_t seed, int64_t num_layers) {
  if (std::filesystem::is_directory(name_or_dir)) {
    if (num_layers > 0)
      return absl::InvalidArgumentError("num_layers can only cut a named shape, not a checkpoint directory");
    return LoadPretrained(name_or_dir, dtype, device);
  }
  absl::StatusOr<ModelConfig> config = NamedShape(name_or_dir);
  if (!config.ok()) return config.status();
  if (num_layers > 0) config->num_hidden_layers = num_layers;
  absl::StatusOr<CausalLM> model = MakeCausalLM(*config);
  if (!model.ok()) return model.status();
  (*model)->to(device);
  (*model)->InitRandom(seed);
  (*model)->to(dtype);
  return model;
}

absl::Status SaveHfCheckpoint(CausalLM& model, const std::string& dir, const SaveOptions& options) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat(dir, ": cannot create directory (", ec.message(), ")"));
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  {
    torch::NoGradGuard no_grad;
    for (auto& p : model->named_parameters()) {
      tensors.emplace_back(p.key(), p.value().detach().to(IsFp32Parameter(p.key()) ? torch::kFloat32 : options.dtype));
    }
  }
  if (absl::Status s = WriteSafetensorsCheckpoint(dir, tensors, options.max_shard_bytes); !s.ok()) return s;
  if (absl::Status s = WriteFileAtomically((std::filesystem::path(dir) / "config.json").string(),
                                           ToHfConfigJson(model->config(), DtypeName(options.dtype)));
      !s.ok())
    return s;
  return CopyModelFolderFiles(options.base_dir, dir);
}

const std::vector<std::string>& ModelFolderFiles() {
  static const std::vector<std::string> files = {
      "tokenizer.json",      "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
      "tokenizer.model",     "spiece.model",          "vocab.json",              "merges.txt",
      "vocab.txt",           "chat_template.jinja",   "chat_template.json",      "generation_config.json"};
  return files;
}

absl::Status CopyModelFolderFiles(const std::string& src, const std::string& dst) {
  std::error_code ec;
  if (src.empty() || !std::filesystem::is_directory(src, ec)) return absl::OkStatus();
  // The largest tokenizer.json files are tens of MB; this bounds a mistaken multi-GB file.
  constexpr size_t kMaxBytes = size_t{1} << 30;
  for (const std::string& name : ModelFolderFiles()) {
    const std::filesystem::path from = std::filesystem::path(src) / name;
    if (!std::filesystem::exists(from, ec)) continue;
    absl::StatusOr<std::string> bytes = ReadRegularFile(from.string(), kMaxBytes);
    if (!bytes.ok()) {
      return absl::Status(bytes.status().code(), absl::StrCat("copying the base model's ", name, ": ",
                                                              bytes.status().message()));
    }
    if (absl::Status s = WriteFileAtomically((std::filesystem::path(dst) / name).string(), *bytes); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<torch::Dtype> ParseDtype(const std::string& name) {
  if (name == "float32" || name == "fp32") return torch::kFloat32;
  if (name == "bfloat16" || name == "bf16") return torch::kBFloat16;
  if (name == "float16" || name == "fp16") return torch::kFloat16;
  return absl::InvalidArgumentError(absl::StrCat("dtype '", name, "' is not one of float32, bfloat16, float16"));
}

std::string DtypeName(torch::Dtype dtype) {
  switch (dtype) {
    case torch::kFloat32: return "float32";
    case torch::kBFloat16: return "bfloat16";
    case torch::kFloat16: return "float16";
    default: return std::string(c10::toString(dtype));
  }
}

}  // namespace odyssey::model
