#include "engine/loss.h"

#include <vector>

#include <torch/torch.h>

namespace odyssey::engine {

torch::Tensor LogitsFp32(const torch::Tensor& hidden, const torch::Tensor& head_weight) {
  const bool half = hidden.scalar_type() == torch::kBFloat16 || hidden.scalar_type() == torch::kHalf;
  const bool recorded = torch::GradMode::is_enabled() && (hidden.requires_grad() || head_weight.requires_grad());
  if (!hidden.is_cuda() || !half || head_weight.scalar_type() != hidden.scalar_type() || recorded)
    return torch::matmul(hidden, head_weight.t()).to(torch::kFloat32);
  // at::mm's fp32-output form (CUDA only, no autograd formula: hence the conditions above).
  const torch::Tensor h = hidden.reshape({-1, hidden.size(-1)});
  std::vector<int64_t> shape(hidden.sizes().begin(), hidden.sizes().end());
  shape.back() = head_weight.size(0);
  return at::mm(h, head_weight.t(), torch::kFloat32).view(shape);
}

torch::Tensor TokenLogprobs(const torch::Tensor& hidden, const torch::Tensor& head_weight,
                            const torch::Tensor& labels) {
  torch::Tensor logits = LogitsFp32(hidden, head_weight);  // (B, S, V)
  torch::Tensor logp = torch::log_softmax(logits, -1);                               // (B, S, V)
  return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1);                          // (B, S)
}

torch::Tensor MaskedCrossEntropySum(const torch::Tensor& hidden, const torch::Tensor& head_weight,
                                    const torch::Tensor& labels, const torch::Tensor& mask) {
  return -(TokenLogprobs(hidden, head_weight, labels) * mask.to(torch::kFloat32)).sum();
}

}  // namespace odyssey::engine
