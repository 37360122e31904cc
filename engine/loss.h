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

// log p(label) at every position, fp32 (B, S).
torch::Tensor TokenLogprobs(const torch::Tensor& hidden, const torch::Tensor& head_weight,
                            const torch::Tensor& labels);

}  // namespace odyssey::engine
