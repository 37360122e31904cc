// Model configuration for the dense decoder family (Llama 3.x, Qwen2, Qwen3) and the hybrid
// family (Kimi Delta Attention and DeepSeek Sparse Attention layers by a layer pattern,
// ../shared/specs/hybrid-attention.md), either with optional Mixture-of-Experts MLPs
// (model/moe_config.h).
//
// A ModelConfig is plain data: built from a Hugging Face config.json, from a named random-init
// shape, or by hand, then checked with Validate(). It links no libtorch, so the planner, the
// controller and the CLI can use it. Thread safety: a value type; no shared state.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/moe_config.h"

namespace odyssey::model {

enum class Architecture { kLlama, kQwen2, kQwen3, kHybrid };

// Which of the two indexer-training stages of spec 2.3 a hybrid model's DSA layers run.
enum class IndexerStage {
  kDenseWarmup,  // main attention dense causal; the indexer's KL over every visible pool
  kSparse,       // main attention over the selected keys; the KL over the selected pools only
};

// The hybrid family's layers (Architecture::kHybrid). Every layer is token mixer + SwiGLU MLP
// with pre-norms, as in the dense family; the mixer is KDA or DSA by `layer_pattern`. No RoPE
// (NoPE, as GLM-5.3-Flash). The DSA layers' main attention is GQA with the ModelConfig's
// num_attention_heads / num_key_value_heads / head_dim.
struct HybridConfig {
  // One letter per layer, repeated to num_hidden_layers: 'K' a KDA layer, 'D' a DSA layer
  // ("KKKD": 3 KDA : 1 DSA). num_hidden_layers must be a multiple of its length.
  std::string layer_pattern = "KKKD";
  // KDA (spec 1.1): H q/k heads = HV value heads of head dim K = V.
  int64_t kda_num_heads = 0;
  int64_t kda_head_dim = 0;
  int64_t kda_conv_kernel = 4;        // depthwise causal short conv over q, k, v
  int64_t kda_chunk_size = 64;        // C of the chunked form: 32 or 64 (multiple of 16)
  double kda_gate_lower_bound = -5.0; // lb of the safe gate g = lb sigmoid(...) in (lb, 0); < 0
  // DSA (spec 2.1, 2.4): the lightning indexer over pools of 4 keys.
  int64_t index_num_heads = 0;
  int64_t index_head_dim = 0;
  int64_t index_top_k = 2048;         // selected tokens per query: index_top_k / 4 pools (+ tail)
  double indexer_loss_weight = 1.0;   // weight of the indexer KL in the training loss; 0: off
  IndexerStage indexer_stage = IndexerStage::kSparse;
};

// How the KDA mixer runs long documents (not model fields: the training code's working-set
// bounds, which the planner counts too). Documents longer than kKdaTile tokens run in sequence
// tiles (model::KdaAttentionImpl); inside a tile the chunked KDA op works a segment of
// kKdaSegment tokens at a time (kernels::KdaOptions::segment). A layer's backward holds one
// tile's autograd state and one segment's fp32 intermediates.
constexpr int64_t kKdaTile = 32768;
constexpr int64_t kKdaSegment = 8192;
// The DSA layer's sparse stage runs kDsaTile queries at a time against the whole sequence's keys
// (model::DsaAttentionImpl): its backward holds one tile's per-query tensors.
constexpr int64_t kDsaTile = 32768;

// Llama-3 style RoPE frequency scaling ("rope_scaling": {"rope_type": "llama3", ...}).
struct RopeScaling {
  bool enabled = false;             // false: plain RoPE with rope_theta.
  double factor = 8.0;              // long-wavelength divisor.
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

struct ModelConfig {
  Architecture architecture = Architecture::kLlama;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // GQA: must divide num_attention_heads.
  int64_t head_dim = 0;             // 0: hidden_size / num_attention_heads.
  int64_t max_position_embeddings = 0;  // longest sequence a job may ask for.
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // bias on q/k/v/o (Llama); Qwen2 has q/k/v bias always.
  bool mlp_bias = false;        // bias on gate/up/down (Llama only).
  // Token ids written to config.json on export; -1 leaves them out.
  int64_t bos_token_id = -1;
  int64_t eos_token_id = -1;
  HybridConfig hybrid;  // read only when architecture == kHybrid
  // Mixture-of-Experts MLPs (model/moe_config.h), in either family: in the dense one as Qwen3-MoE
  // (qwen3, no shared expert) or Qwen2-MoE (qwen2, with one); in the hybrid one with or without a
  // shared expert. num_experts 0: every MLP is dense.
  MoeConfig moe;

  bool IsHybrid() const { return architecture == Architecture::kHybrid; }
  // A hybrid model whose DSA indexers are in their dense warm-up (spec 2.3): only the indexers
  // train, from their KL against the dense attention.
  bool InDenseWarmup() const { return IsHybrid() && hybrid.indexer_stage == IndexerStage::kDenseWarmup; }
  // 'K' or 'D' for layer i of a hybrid model; 'A' (dense attention) otherwise.
  char LayerKind(int64_t i) const;
  int64_t NumLayersOfKind(char kind) const;
  // Why the memory stack's head_groups (> 1) cannot act on this model, as a phrase to follow the
  // field and its value; empty where it acts. (That it divides the KV heads is checked with the
  // memory fields.) The dense family: the attention backend runs the KV heads in groups. The
  // hybrid family: the DSA layers do (their sparse stage's backward, DsaAttentionImpl::
  // set_head_groups, and the dense warm-up's attention), on one rank per sequence (context
  // parallelism's ranks split those heads already); KDA layers have no KV heads.
  std::string HeadGroupsRefusal(int64_t head_groups, int64_t context_parallel) const;

  int64_t HeadDim() const { return head_dim > 0 ? head_dim : hidden_size / num_attention_heads; }
  bool QkvBias() const { return architecture == Architecture::kQwen2 || attention_bias; }
  bool OBias() const { return architecture != Architecture::kQwen2 && attention_bias; }
  bool QkNorm() const { return architecture == Architecture::kQwen3; }
  bool UsesRope() const { return !IsHybrid(); }
  // Parameter count (embeddings counted once when tied).
  int64_t NumParameters() const;
  // The DSA layers' indexers' parameters (0 for the dense family): what the dense warm-up trains.
  int64_t IndexerParameters() const;

  // Checks every field; the message names the field and the rule that failed.
  absl::Status Validate() const;
};

// Parses a Hugging Face config.json text. `source` names it in error messages.
absl::StatusOr<ModelConfig> ParseHfConfig(const std::string& json_text, const std::string& source);
// Reads <dir>/config.json.
absl::StatusOr<ModelConfig> LoadHfConfig(const std::string& checkpoint_dir);
// The config.json text transformers needs to load an exported checkpoint.
std::string ToHfConfigJson(const ModelConfig& config, const std::string& torch_dtype);

// "dense_warmup" / "sparse"; errors name the field and the values.
absl::StatusOr<IndexerStage> ParseIndexerStage(const std::string& name);
const char* IndexerStageName(IndexerStage stage);

// Named random-init shapes: tiny, llama-3.2-1b, llama-3.2-3b, llama-3.1-8b, hybrid-tiny,
// hybrid-3b, and with MoE MLPs qwen3-moe-tiny, hybrid-tiny-moe, hybrid-3b-moe.
absl::StatusOr<ModelConfig> NamedShape(const std::string& name);
std::vector<std::string> NamedShapeNames();

// Resolves a model reference: a named shape, or a checkpoint directory with config.json.
absl::StatusOr<ModelConfig> ResolveModelConfig(const std::string& name_or_dir);

// What a job (or a benchmark) may change of the model it names.
struct ModelOverrides {
  int64_t num_layers = 0;     // > 0: cut a named shape to this many layers (benchmarks); refused for a directory
  std::string indexer_stage;  // "" = the config's; "dense_warmup" | "sparse": hybrid models with DSA layers
  // > 0: the KDA layers' chunk size C (32 or 64; benchmarks: the weights do not depend on it);
  // refused for a model without KDA layers. 0 = the config's.
  int64_t kda_chunk_size = 0;
};
// ResolveModelConfig with `o` applied. Errors name `field_prefix` + "indexer_stage" /
// "num_layers" / "kda_chunk_size" and the rule. A warm-up checkpoint (config.json: dense_warmup) trains sparse with
// indexer_stage "sparse", and the checkpoints that job writes say so.
absl::StatusOr<ModelConfig> ResolveModelConfig(const std::string& name_or_dir, const ModelOverrides& o,
                                               const std::string& field_prefix = "");
// Sets config->hybrid.indexer_stage from `stage` (empty: leaves it); refused, naming `field`,
// for a value not dense_warmup / sparse or a model without DSA layers.
absl::Status SetIndexerStage(const std::string& field, const std::string& stage, ModelConfig* config);

// LoRA adapters (PEFT's LoraLayer) on the attention and MLP projections: each targeted
// projection y = x W^T (+ b) gains scale * (x A^T) B^T with A (rank, in), B (out, rank),
// scale = alpha / rank. The base weights are frozen (no gradients, no optimizer state); only A and
// B train. Plain data shared by the controller's validation, the planner and the engine (the
// JobSpec's LoraSpec converts to it once: planner/memory_spec.h LoraFromProto).
struct LoraConfig {
  int64_t rank = 0;      // 0: no adapters (full fine-tuning); else in [1, 1024] and <= every target's dims
  double alpha = 0;      // > 0 and finite; 0 = rank (scale 1)
  double dropout = 0;    // must be 0: dropout on the adapters' input is not implemented
  // Hugging Face module names of the projections that get adapters; empty = all seven.
  std::vector<std::string> target_modules;
  // Exports (ExportWeights) write merged weights (W + scale B A, a plain model folder) instead of
  // the PEFT adapter folder; checkpoints also carry a merged/ model folder. Checkpoints always
  // hold the adapters themselves (resume needs them).
  bool merge = false;

  bool enabled() const { return rank > 0; }
  double scale() const { return (alpha > 0 ? alpha : static_cast<double>(rank)) / static_cast<double>(rank); }
  // The targets, all seven when target_modules is empty, in LoraTargetNames() order.
  std::vector<std::string> Targets() const;
  // Checks every field; messages are "<prefix>.<field>: (<value>) <rule>". With `model`, also
  // that rank fits every targeted projection's dims.
  absl::Status Validate(const std::string& prefix = "lora", const ModelConfig* model = nullptr) const;
  // Trainable parameters (A and B of every targeted projection of every layer).
  int64_t NumParameters(const ModelConfig& model) const;
};
// q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj.
const std::vector<std::string>& LoraTargetNames();
// PEFT's adapter_config.json for `lora` on the model loaded from `base_model` (a folder or a
// named shape): peft.PeftModel.from_pretrained(base, folder) reads it.
std::string ToPeftAdapterConfigJson(const LoraConfig& lora, const std::string& base_model);
// Reads a PEFT adapter_config.json text back (rank, alpha, dropout, targets); errors name the key.
absl::StatusOr<LoraConfig> ParsePeftAdapterConfig(const std::string& json_text, const std::string& source);

}  // namespace odyssey::model
