// Loading and saving CausalLM weights as Hugging Face checkpoints (config.json + safetensors),
// by HF tensor names. A directory odyssey writes loads back into transformers unchanged.
#pragma once

#include <string>

#include <torch/types.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/causal_lm.h"

namespace odyssey::model {

// Copies every parameter of `model` from the checkpoint in `dir` (dtype converted to the
// parameter's). Errors name the file and the tensor: a missing tensor, a wrong shape, an
// integer tensor where a float is expected. Tensors the model does not use are ignored.
absl::Status LoadHfWeights(CausalLM& model, const std::string& dir);

// config.json + weights from `dir`, placed on `device` in `dtype`.
absl::StatusOr<CausalLM> LoadPretrained(const std::string& dir, torch::Dtype dtype, torch::Device device);

// A model from a named shape (random init with `seed`, drawn on `device`) or a checkpoint
// directory. num_layers > 0 cuts a named shape to that many layers (for benchmarks).
absl::StatusOr<CausalLM> LoadModel(const std::string& name_or_dir, torch::Dtype dtype, torch::Device device,
                                   uint64_t seed = 0, int64_t num_layers = 0);

struct SaveOptions {
  torch::Dtype dtype = torch::kBFloat16;        // dtype written (and named in config.json)
  int64_t max_shard_bytes = int64_t{5} << 30;  // above this, shards + index json
};
// Writes config.json and the weights to `dir` (created if needed).
absl::Status SaveHfCheckpoint(CausalLM& model, const std::string& dir, const SaveOptions& options = {});

// "float32" / "bfloat16" / "float16" <-> dtype; errors name the rule.
absl::StatusOr<torch::Dtype> ParseDtype(const std::string& name);
std::string DtypeName(torch::Dtype dtype);

}  // namespace odyssey::model
