// Losses over the model's final hidden states and LM head weight.
//
// v0 computes the (B, S, vocab) logits of the batch in fp32. The tiled LM head + loss of the
// memory stack (engine/memory/) replaces this for long sequences with the same contract.
#pragma once

#include <torch/types.h>

namespace odyssey::engine {

// Sum over positions of -log p(label) * mask, in fp32 (a differentiable scalar).
// hidden (B, S, H), head_weight (V, H), labels (B, S) int64, mask (B, S) float.
torch::Tensor MaskedCrossEntropySum(const torch::Tensor& hidden, const torch::Tensor& head_weight,
                                    const torch::Tensor& labels, const torch::Tensor& mask);

// hidden (..., H) @ head_weight (V, H)^T as fp32 logits (..., V). With 16-bit CUDA operands and
// no gradient to record: one GEMM whose output is fp32 (the products are summed in fp32 either
// way; the logits are not rounded to 16 bits first, and no 16-bit copy of the tile exists beside
// the fp32 one). Otherwise the product in the operands' dtype, then fp32 (autograd records it).
torch::Tensor LogitsFp32(const torch::Tensor& hidden, const torch::Tensor& head_weight);

// log p(label) at every position, fp32 (B, S).
torch::Tensor TokenLogprobs(const torch::Tensor& hidden, const torch::Tensor& head_weight,
                            const torch::Tensor& labels);

}  // namespace odyssey::engine
