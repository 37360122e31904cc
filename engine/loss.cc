#include "engine/loss.h"

#include <torch/torch.h>

namespace odyssey::engine {

torch::Tensor TokenLogprobs(const torch::Tensor& hidden, const torch::Tensor& head_weight,
                            const torch::Tensor& labels) {
  torch::Tensor logits = torch::matmul(hidden, head_weight.t()).to(torch::kFloat32);  // (B, S, V)
  torch::Tensor logp = torch::log_softmax(logits, -1);                               // (B, S, V)
  return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1);                          // (B, S)
}

torch::Tensor MaskedCrossEntropySum(const torch::Tensor& hidden, const torch::Tensor& head_weight,
                                    const torch::Tensor& labels, const torch::Tensor& mask) {
  return -(TokenLogprobs(hidden, head_weight, labels) * mask.to(torch::kFloat32)).sum();
}

}  // namespace odyssey::engine
