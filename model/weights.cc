#include "model/weights.h"

#include <filesystem>
#include <set>

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
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
    if (IsLoraParameter(p.key())) continue;  // adapters load from their own folder (LoadLoraAdapter)
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
  return LoadModel(name_or_dir, ModelOverrides{num_layers, ""}, dtype, device, seed);
}

absl::StatusOr<CausalLM> LoadModel(const std::string& name_or_dir, const ModelOverrides& overrides,
                                   torch::Dtype dtype, torch::Device device, uint64_t seed) {
  absl::StatusOr<ModelConfig> config = ResolveModelConfig(name_or_dir, overrides);
  if (!config.ok()) return config.status();
  absl::StatusOr<CausalLM> model = MakeCausalLM(*config);
  if (!model.ok()) return model.status();
  std::error_code ec;
  if (std::filesystem::is_directory(name_or_dir, ec)) {
    (*model)->to(device, dtype);
    if (absl::Status s = LoadHfWeights(*model, name_or_dir); !s.ok()) return s;
    return model;
  }
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
    // Adapters folded into their projections: a plain model folder (MergedParameters); the
    // hybrid layers' fp32 gates stay fp32.
    for (auto& [name, t] : MergedParameters(*model)) {
      tensors.emplace_back(name, t.to(IsFp32Parameter(name) ? torch::kFloat32 : options.dtype));
    }
  }
  if (absl::Status s = WriteSafetensorsCheckpoint(dir, tensors, options.max_shard_bytes); !s.ok()) return s;
  if (absl::Status s = WriteFileAtomically((std::filesystem::path(dir) / "config.json").string(),
                                           ToHfConfigJson(model->config(), DtypeName(options.dtype)));
      !s.ok())
    return s;
  return CopyModelFolderFiles(options.base_dir, dir);  // the base model's tokenizer and generation files
}

namespace {
constexpr char kPeftPrefix[] = "base_model.model.";
}  // namespace

absl::Status SaveLoraAdapter(CausalLM& model, const std::string& dir, torch::Dtype dtype, const std::string& base_model) {
  if (!model->lora().enabled()) return absl::FailedPreconditionError("the model has no LoRA adapters to save");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat(dir, ": cannot create directory (", ec.message(), ")"));
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  {
    torch::NoGradGuard no_grad;
    for (auto& p : model->named_parameters())
      if (IsLoraParameter(p.key())) tensors.emplace_back(kPeftPrefix + p.key(), p.value().detach().to(dtype));
  }
  const std::filesystem::path root(dir);
  if (absl::Status s = WriteSafetensors((root / "adapter_model.safetensors").string(), tensors); !s.ok()) return s;
  return WriteFileAtomically((root / "adapter_config.json").string(),
                             ToPeftAdapterConfigJson(model->lora(), base_model));
}

absl::Status CheckLoraAdapter(CausalLM& model, const std::string& dir) {
  if (!model->lora().enabled()) return absl::FailedPreconditionError("the model has no LoRA adapters to load into");
  const std::filesystem::path root(dir);
  const std::string config_path = (root / "adapter_config.json").string();
  absl::StatusOr<std::string> text = ReadRegularFile(config_path, size_t{1} << 20);
  if (!text.ok()) return text.status();
  absl::StatusOr<LoraConfig> saved = ParsePeftAdapterConfig(*text, config_path);
  if (!saved.ok()) return saved.status();
  const LoraConfig& mine = model->lora();
  if (saved->rank != mine.rank || saved->Targets() != mine.Targets() || saved->scale() != mine.scale())
    return absl::FailedPreconditionError(absl::StrCat(
        config_path, ": adapters of rank ", saved->rank, " on ", absl::StrJoin(saved->Targets(), ","), " (scale ",
        saved->scale(), "), the job's lora is rank ", mine.rank, " on ", absl::StrJoin(mine.Targets(), ","), " (scale ",
        mine.scale(), ")"));
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      SafetensorsFile::Open((root / "adapter_model.safetensors").string());
  if (!file.ok()) return file.status();
  for (auto& p : model->named_parameters()) {
    if (!IsLoraParameter(p.key())) continue;
    auto it = (*file)->tensors().find(kPeftPrefix + p.key());
    if (it == (*file)->tensors().end())
      return absl::FailedPreconditionError(absl::StrCat(dir, ": adapter_model.safetensors lacks '", kPeftPrefix,
                                                        p.key(), "'"));
    if (it->second.shape != p.value().sizes().vec())
      return absl::FailedPreconditionError(absl::StrCat(dir, ": '", kPeftPrefix, p.key(), "' has shape [",
                                                        absl::StrJoin(it->second.shape, ", "), "], the model's is [",
                                                        absl::StrJoin(p.value().sizes().vec(), ", "), "]"));
  }
  return absl::OkStatus();
}

absl::Status LoadLoraAdapter(CausalLM& model, const std::string& dir) {
  if (absl::Status s = CheckLoraAdapter(model, dir); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      SafetensorsFile::Open((std::filesystem::path(dir) / "adapter_model.safetensors").string());
  if (!file.ok()) return file.status();
  torch::NoGradGuard no_grad;
  for (auto& p : model->named_parameters()) {
    if (!IsLoraParameter(p.key())) continue;
    absl::StatusOr<torch::Tensor> t = (*file)->Read(kPeftPrefix + p.key());
    if (!t.ok()) return t.status();
    p.value().copy_(*t);
  }
  return absl::OkStatus();
}

absl::Status ExportModel(CausalLM& model, const std::string& dir, const SaveOptions& options) {
  if (!model->lora().enabled() || model->lora().merge) return SaveHfCheckpoint(model, dir, options);
  if (absl::Status s = SaveLoraAdapter(model, dir, options.dtype, options.base_dir); !s.ok()) return s;
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
