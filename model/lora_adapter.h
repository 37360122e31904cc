// A LoRA adapter on one projection (PEFT's LoraLayer, dropout 0), shared by the dense layers
// (layers.h) and the hybrid family's KDA and DSA layers (hybrid.h). Implemented in layers.cc.
// Thread safety: as the modules that hold them.
#pragma once

#include <torch/nn/modules/linear.h>

namespace odyssey::model {

// The projection's output gains scale * (x A^T) B^T. A = lora_A.weight (rank, in), B =
// lora_B.weight (out, rank) are Linear modules registered under the projection's own module
// (AttachLora, model/causal_lm.h), so named_parameters() are PEFT's names:
// model.layers.N.self_attn.q_proj.lora_A.weight. Null handles (the default) mean no adapter.
struct LoraAdapter {
  torch::nn::Linear A{nullptr}, B{nullptr};
  double scale = 0;
  explicit operator bool() const { return static_cast<bool>(A); }
};
// linear(x) plus the adapter's term when it has one. x (..., in) -> (..., out).
torch::Tensor Project(const torch::nn::Linear& linear, const LoraAdapter& lora, const torch::Tensor& x);
// scale * (x A^T) B^T. REQUIRES: lora. x (..., in) -> (..., out).
torch::Tensor LoraDelta(const LoraAdapter& lora, const torch::Tensor& x);
// Rows [first, first + count) of Project(linear, lora, x): those output features only, through
// the same rows of the weight (and of B). x (..., in) -> (..., count). No bias.
torch::Tensor ProjectRows(const torch::nn::Linear& linear, const LoraAdapter& lora, const torch::Tensor& x,
                          int64_t first, int64_t count);

}  // namespace odyssey::model
