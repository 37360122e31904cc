#include "engine/rl_loss.h"

#include <algorithm>

#include <torch/torch.h>

namespace odyssey::engine {
namespace {

// log r is clamped to this range before exp: a sampler logprob far below the trainer's (a
// broken or mismatched inference engine) would otherwise overflow r to inf and turn the whole
// gradient into NaN. r stays within [2e-9, 4.9e8]; tokens beyond get no ratio gradient.
constexpr double kMaxLogRatio = 20.0;

torch::Tensor Ratio(const torch::Tensor& logp, const torch::Tensor& sampler_logprobs) {
  return torch::exp(torch::clamp(logp - sampler_logprobs, -kMaxLogRatio, kMaxLogRatio));  // (S,)
}

}  // namespace

DatumTensors ToTensors(const Datum& datum, torch::Device device) {
  const int64_t S = static_cast<int64_t>(datum.tokens.size());
  auto tensor = [&](const std::vector<float>& v) -> torch::Tensor {
    if (v.empty()) return torch::Tensor();
    return torch::tensor(torch::ArrayRef<float>(v), torch::kFloat32).to(device);  // (S,)
  };
  DatumTensors t;
  t.weights = datum.weights.empty() ? torch::ones({S}, torch::dtype(torch::kFloat32).device(device)) : tensor(datum.weights);
  t.sampler_logprobs = tensor(datum.sampler_logprobs);
  t.advantages = tensor(datum.advantages);
  return t;
}

torch::Tensor DatumLossSum(const torch::Tensor& logp, const DatumTensors& in, const LossSpec& spec) {
  TORCH_CHECK(logp.dim() == 1 && logp.sizes() == in.weights.sizes(), "logp and weights must be (S,)");
  // Tokens of weight 0 are selected out rather than multiplied by 0, so that whatever they hold
  // (an extreme ratio) never reaches the sum or its gradient.
  const torch::Tensor counted = in.weights > 0;  // (S,) bool
  torch::Tensor per_token;                       // (S,) fp32: the integrand before -w
  switch (spec.kind) {
    case LossKind::kCrossEntropy:
      per_token = logp;
      break;
    case LossKind::kImportanceSampling:
      per_token = Ratio(logp, in.sampler_logprobs) * in.advantages;
      break;
    case LossKind::kPpo: {
      const torch::Tensor r = Ratio(logp, in.sampler_logprobs);  // (S,)
      const torch::Tensor clipped = torch::clamp(r, 1.0 - spec.clip_low, 1.0 + spec.clip_high);
      per_token = torch::min(r * in.advantages, clipped * in.advantages);
      break;
    }
    case LossKind::kUnspecified:
      TORCH_CHECK(false, "DatumLossSum: unvalidated loss kind ", static_cast<int>(spec.kind));
  }
  return -torch::where(counted, in.weights * per_token, torch::zeros_like(per_token)).sum();
}

int64_t PpoClippedTokens(const torch::Tensor& logp, const DatumTensors& in, const LossSpec& spec) {
  if (spec.kind != LossKind::kPpo) return 0;
  torch::NoGradGuard no_grad;
  const torch::Tensor r = Ratio(logp.detach(), in.sampler_logprobs);  // (S,)
  const torch::Tensor a = in.advantages;
  const torch::Tensor clipped = ((a > 0) & (r > 1.0 + spec.clip_high)) | ((a < 0) & (r < 1.0 - spec.clip_low));
  return (clipped & (in.weights > 0)).sum().item<int64_t>();
}

void Mismatch::Add(const torch::Tensor& logp, const DatumTensors& in) {
  if (!in.sampler_logprobs.defined()) return;
  torch::NoGradGuard no_grad;
  const torch::Tensor counted = in.weights > 0;                                     // (S,) bool
  const torch::Tensor delta = (logp.detach() - in.sampler_logprobs).abs().masked_select(counted);  // (n,)
  const int64_t n = delta.numel();
  if (n == 0) return;
  sum_abs += delta.to(torch::kFloat64).sum().item<double>();
  max_abs = std::max(max_abs, delta.max().item<double>());
  tokens += n;
}

}  // namespace odyssey::engine
