// CausalLM: a decoder-only language model of the dense family (Llama 3.x, Qwen2, Qwen3) or the
// hybrid family (KDA and DSA layers by a layer pattern, model/hybrid.h).
//
// Module tree mirrors transformers' *ForCausalLM, so named_parameters() are the HF tensor names:
//   model.embed_tokens.weight, model.layers.{i}.{self_attn,mlp,...}, model.norm.weight,
//   lm_head.weight (absent when tie_word_embeddings: the head reuses the embedding).
// The model computes hidden states; the engine computes the head + loss (tiled or not) from
// Hidden() and HeadWeight(), and may wrap every decoder layer through a LayerStackRunner (recompute,
// offload, tiling). Thread safety: one thread at a time.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>

#include "absl/status/statusor.h"
#include "model/attention.h"
#include "model/config.h"
#include "model/layers.h"

namespace odyssey::model {

// Runs the whole stack of decoder layers on h (B, S, hidden) and returns the last layer's
// output. The default runs layer->forward(h, ctx) in order. Engine memory strategies
// (recompute, offload, tiling, nested checkpoints over groups of layers) are runners.
using LayerStackRunner = std::function<torch::Tensor(const std::vector<DecoderLayer>& layers, const torch::Tensor& h,
                                                     const LayerContext& ctx)>;

// The inputs of one forward pass.
struct ForwardInputs {
  torch::Tensor input_ids;     // (B, S) int64
  torch::Tensor position_ids;  // (B, S) int64; undefined = 0..S-1 for every row
  const std::vector<std::vector<int64_t>>* doc_lens = nullptr;  // packed documents per row
};

class DecoderModelImpl : public torch::nn::Module {
 public:
  explicit DecoderModelImpl(const ModelConfig& config);
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  RMSNorm norm{nullptr};
  std::vector<DecoderLayer> layer_list;  // typed handles into `layers`
};
TORCH_MODULE(DecoderModel);

class CausalLMImpl : public torch::nn::Module {
 public:
  explicit CausalLMImpl(const ModelConfig& config);

  const ModelConfig& config() const { return config_; }
  // The attention backend every layer uses (default "auto").
  void set_attention_backend(std::shared_ptr<const AttentionBackend> backend) { backend_ = std::move(backend); }
  const AttentionBackend& attention_backend() const { return *backend_; }
  // The ranks sharing each sequence under context parallelism, for the hybrid family's KDA and
  // DSA layers (LayerContext::sequence; null, the default: one rank holds whole rows). The
  // dense family's context parallelism is its attention backend's.
  void set_sequence_group(std::shared_ptr<const SequenceGroup> group) { sequence_ = std::move(group); }

  // Final normed hidden states (B, S, hidden). `runner` runs the decoder layers (may be empty).
  torch::Tensor Hidden(const ForwardInputs& in, const LayerStackRunner& runner = nullptr);
  // The LM head weight (vocab, hidden): lm_head.weight, or the embedding when tied.
  torch::Tensor HeadWeight() const;
  // Full logits (B, S, vocab) in the params' dtype. For tests and short sequences only: the
  // engine's losses never materialize (S, vocab) at long S.
  torch::Tensor Logits(const ForwardInputs& in);

  // The hybrid family's indexer KL (spec 2.3) of the last pass that trained it, summed over the
  // DSA layers (fp32 scalar, detached; each layer's term enters the training gradient with
  // weight hybrid.indexer_loss_weight); undefined for the dense family or before such a pass.
  torch::Tensor IndexerLoss() const;

  // Random init as transformers does (normal(0, 0.02) weights, zero biases, unit norms; the
  // hybrid layers' convs, A_log and dt_bias as spec 1.1 says).
  void InitRandom(uint64_t seed, double std = 0.02);

  DecoderModel model{nullptr};
  torch::nn::Linear lm_head{nullptr};  // null when tied

  // The adapters AttachLora added (rank 0: none).
  const LoraConfig& lora() const { return lora_; }

 private:
  friend absl::Status AttachLora(CausalLMImpl& model, const LoraConfig& lora, uint64_t seed);
  ModelConfig config_;
  LoraConfig lora_;
  std::shared_ptr<const AttentionBackend> backend_;
  std::shared_ptr<const SequenceGroup> sequence_;
  torch::Tensor inv_freq_cpu_;  // (D/2,) fp32, moved to the input's device per call
};
TORCH_MODULE(CausalLM);

// Builds a model from a validated config. Errors name the config field that is wrong.
absl::StatusOr<CausalLM> MakeCausalLM(const ModelConfig& config);

// Adds LoRA adapters to every layer's targeted projections, in the base weights' dtype and on
// their device, initialized as PEFT does (A Kaiming-uniform as nn.Linear's default, drawn from a
// generator seeded with `seed`; B zeros, so the model's outputs are unchanged), and freezes
// every base parameter (requires_grad false): only the adapters train. Errors (INVALID_ARGUMENT)
// name the lora field; FAILED_PRECONDITION when the model already has adapters.
absl::Status AttachLora(CausalLMImpl& model, const LoraConfig& lora, uint64_t seed);
// True for the name of an adapter parameter (".lora_A." / ".lora_B.").
bool IsLoraParameter(const std::string& name);
// The model's parameters as a plain model holds them: the adapters' W + scale * B A folded into
// their projections' weights (in fp32, then the weight's dtype), adapter tensors left out. Names
// are the Hugging Face ones. A model without adapters: its parameters as they are.
std::vector<std::pair<std::string, torch::Tensor>> MergedParameters(CausalLMImpl& model);

}  // namespace odyssey::model
