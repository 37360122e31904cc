// Loading and saving CausalLM weights as Hugging Face checkpoints (config.json + safetensors),
// by HF tensor names. A directory odyssey writes loads back into transformers unchanged.
#pragma once

#include <string>
#include <vector>

#include <torch/types.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/causal_lm.h"

namespace odyssey::model {

// Copies every parameter of `model` but LoRA adapters from the checkpoint in `dir` (dtype converted to the
// parameter's). Errors name the file and the tensor: a missing tensor, a wrong shape, an
// integer tensor where a float is expected. Tensors the model does not use are ignored.
absl::Status LoadHfWeights(CausalLM& model, const std::string& dir);

// config.json + weights from `dir`, placed on `device` in `dtype`.
absl::StatusOr<CausalLM> LoadPretrained(const std::string& dir, torch::Dtype dtype, torch::Device device);

// A model from a named shape (random init with `seed`, drawn on `device`) or a checkpoint
// directory. num_layers > 0 cuts a named shape to that many layers (for benchmarks).
absl::StatusOr<CausalLM> LoadModel(const std::string& name_or_dir, torch::Dtype dtype, torch::Device device,
                                   uint64_t seed = 0, int64_t num_layers = 0);
// The same with what a job may change of the model (ResolveModelConfig's overrides: a warm-up
// checkpoint loaded for the sparse indexer stage, a named shape cut to fewer layers).
absl::StatusOr<CausalLM> LoadModel(const std::string& name_or_dir, const ModelOverrides& overrides,
                                   torch::Dtype dtype, torch::Device device, uint64_t seed = 0);

struct SaveOptions {
  torch::Dtype dtype = torch::kBFloat16;        // dtype written (and named in config.json)
  int64_t max_shard_bytes = int64_t{5} << 30;  // above this, shards + index json
  // The folder the model was loaded from (a job's model.name), or a named shape / empty: what
  // CopyModelFolderFiles copies into the saved folder from there, when it is a folder.
  std::string base_dir{};
};
// Writes config.json and the weights to `dir` (created if needed; LoRA adapters merged into
// their projections, MergedParameters), then the tokenizer and
// generation files of options.base_dir (CopyModelFolderFiles), so the folder is a complete model
// that transformers and vLLM load as is.
absl::Status SaveHfCheckpoint(CausalLM& model, const std::string& dir, const SaveOptions& options = {});

// A PEFT adapter folder for the model's LoRA adapters: adapter_config.json (ToPeftAdapterConfigJson,
// naming `base_model`) and adapter_model.safetensors with PEFT's tensor names
// ("base_model.model." + the parameter's name, e.g. base_model.model.model.layers.0.self_attn.
// q_proj.lora_A.weight) in `dtype`: peft.PeftModel.from_pretrained(base, dir) loads it.
// FAILED_PRECONDITION when the model has no adapters.
absl::Status SaveLoraAdapter(CausalLM& model, const std::string& dir, torch::Dtype dtype, const std::string& base_model);
// Checks that `dir` holds adapters of the model's LoRA config (rank, targets, scale) with every
// tensor at the model's shape, reading no tensor data; errors name the file and the mismatch.
absl::Status CheckLoraAdapter(CausalLM& model, const std::string& dir);
// CheckLoraAdapter, then copies the adapters from `dir` into the model (nothing is copied when
// the check fails).
absl::Status LoadLoraAdapter(CausalLM& model, const std::string& dir);

// What an export writes (ExportWeights): for a model with LoRA adapters, the PEFT adapter folder
// (SaveLoraAdapter, naming options.base_dir as the base model) plus the base folder's tokenizer
// and generation files, or with lora().merge the merged model folder; otherwise SaveHfCheckpoint.
absl::Status ExportModel(CausalLM& model, const std::string& dir, const SaveOptions& options);

// The files of a Hugging Face model folder that are not weights or config.json and that a
// loader needs beside them: tokenizer files (tokenizer.json, tokenizer_config.json,
// special_tokens_map.json, added_tokens.json, tokenizer.model, the vocab/merges files), chat
// templates (chat_template.jinja, chat_template.json) and generation_config.json.
const std::vector<std::string>& ModelFolderFiles();
// Copies those of ModelFolderFiles() that `src` has into `dst` (each through the atomic writer);
// a `src` that is not a folder (a named shape) copies nothing. Errors name the file.
absl::Status CopyModelFolderFiles(const std::string& src, const std::string& dst);

// "float32" / "bfloat16" / "float16" <-> dtype; errors name the rule.
absl::StatusOr<torch::Dtype> ParseDtype(const std::string& name);
std::string DtypeName(torch::Dtype dtype);

}  // namespace odyssey::model
