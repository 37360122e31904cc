// The layers of the dense decoder family (Llama 3.x, Qwen2, Qwen3), as libtorch modules whose
// parameter names are the Hugging Face tensor names (so checkpoints load by name).
//
// Pure math: no offload, no process groups. Engine strategies wrap whole layers (recompute,
// offload) or the two halves of a layer (AttentionBlock / MlpBlock, for tiling) from outside.
// Thread safety: modules are used by one thread at a time.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include "model/attention.h"
#include "model/config.h"
#include "model/hybrid.h"
#include "model/lora_adapter.h"

namespace odyssey::model {

// RMSNorm as Hugging Face computes it: normalize in fp32, cast back, then scale.
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps);
  torch::Tensor forward(const torch::Tensor& x);  // (..., dim) -> (..., dim)
  // Rows are normalized in chunks of about this many elements, bounding the fp32 temporaries
  // (forward and backward) at long sequences. Results do not depend on it.
  void set_chunk_elements(int64_t n) { chunk_elements_ = n; }
  torch::Tensor weight;

 private:
  double eps_;
  int64_t chunk_elements_ = int64_t{64} << 20;
};
TORCH_MODULE(RMSNorm);

// RoPE tables for a batch: cos and sin of shape (B, S, D), in `dtype`.
struct RopeTables {
  torch::Tensor cos;
  torch::Tensor sin;
};
// Inverse frequencies (D/2,) fp32, with Llama-3 scaling when configured.
torch::Tensor RopeInvFreq(const ModelConfig& config, torch::Device device);
// position_ids (B, S) int64.
RopeTables MakeRopeTables(const torch::Tensor& inv_freq, const torch::Tensor& position_ids, torch::Dtype dtype);
// x (B, S, H, D) rotated by the tables (B, S, D) (kernels::Rope).
torch::Tensor ApplyRope(const torch::Tensor& x, const RopeTables& rope);

// LoraAdapter, Project, ProjectRows and LoraDelta: model/lora_adapter.h.

// What every layer of one forward pass shares.
struct LayerContext {
  RopeTables rope;
  AttentionMeta attention;
  const AttentionBackend* backend = nullptr;
  // The ranks sharing the sequence (context parallelism), for the hybrid family's KDA and DSA
  // layers; null: one rank holds whole rows. The dense attention's context parallelism is its
  // backend's (engine/parallel/ulysses.h).
  const SequenceGroup* sequence = nullptr;
  // Recomputes the layer stack's input (the embedding of the ids) without a graph, equal to it
  // bit for bit; CausalLMImpl::Hidden sets it. A runner may call it in backward instead of
  // keeping the input from forward (engine/memory/strategy.cc: the first checkpoint, one
  // (B, S, hidden), is never stored). Empty: the input cannot be recomputed.
  std::function<torch::Tensor()> stack_input;
};

class AttentionImpl : public torch::nn::Module {
 public:
  explicit AttentionImpl(const ModelConfig& config);
  torch::Tensor forward(const torch::Tensor& x, const LayerContext& ctx);  // (B, S, hidden) -> same
  // Everything before o_proj: (B, S, hidden) -> the heads' outputs (B, S, Hq * D).
  torch::Tensor Heads(const torch::Tensor& x, const LayerContext& ctx);
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  RMSNorm q_norm{nullptr}, k_norm{nullptr};  // Qwen3 only
  LoraAdapter q_lora, k_lora, v_lora, o_lora;  // set by AttachLora

 private:
  int64_t heads_, kv_heads_, head_dim_;
};
TORCH_MODULE(Attention);

class MlpImpl : public torch::nn::Module {
 public:
  explicit MlpImpl(const ModelConfig& config);
  torch::Tensor forward(const torch::Tensor& x);  // (..., hidden) -> (..., hidden)
  // silu(gate_proj(x)) * up_proj(x): (..., hidden) -> (..., intermediate), before down_proj.
  torch::Tensor Hidden(const torch::Tensor& x);
  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
  LoraAdapter gate_lora, up_lora, down_lora;  // set by AttachLora
};
TORCH_MODULE(Mlp);

class MoeMlpImpl;  // model/moe.h

// One decoder layer: pre-norm token mixer + pre-norm MLP. The mixer is the dense Attention, or
// for layer `index` of a hybrid model KDA or DSA (ModelConfig::LayerKind), always registered as
// `self_attn`; exactly one of self_attn, kda, dsa is set. The MLP is the dense SwiGLU (`mlp`), or
// in any family the Mixture-of-Experts MLP (`moe`, model/moe.h) when config.moe.IsMoeLayer(index),
// always registered as `mlp`; exactly one of mlp, moe is set.
class DecoderLayerImpl : public torch::nn::Module {
 public:
  explicit DecoderLayerImpl(const ModelConfig& config, int64_t index = 0);
  // h + attn(norm(h)), then + mlp(norm(.)). (B, S, hidden) -> (B, S, hidden)
  torch::Tensor forward(const torch::Tensor& h, const LayerContext& ctx);
  // The two residual halves, for strategies that treat them differently (tiled MLP).
  torch::Tensor AttentionBlock(const torch::Tensor& h, const LayerContext& ctx);  // h + attn(norm(h))
  torch::Tensor MlpBlock(const torch::Tensor& h);                                // h + mlp(norm(h))

  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  Attention self_attn{nullptr};
  KdaAttention kda{nullptr};
  DsaAttention dsa{nullptr};
  Mlp mlp{nullptr};                 // null in an MoE layer
  std::shared_ptr<MoeMlpImpl> moe;  // registered as "mlp" in an MoE layer, else null
};
TORCH_MODULE(DecoderLayer);

}  // namespace odyssey::model
