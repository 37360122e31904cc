#include "engine/rl_loss.h"

#include <cmath>

#include <torch/torch.h>

#include "absl/strings/str_cat.h"

namespace odyssey::engine {
namespace {

// log r is clamped to this range before exp: a sampler logprob far below the trainer's (a
// broken or mismatched inference engine) would otherwise overflow r to inf and turn the whole
// gradient into NaN. r stays within [2e-9, 4.9e8]; tokens beyond get no ratio gradient.
constexpr double kMaxLogRatio = 20.0;
// Weights and advantages beyond this magnitude are refused: with |log r| <= 20 every per-token
// term then stays below ~5e20, so neither the fp32 loss nor its gradients can overflow.
constexpr double kMaxLossInput = 1e6;

// `datum` is the index in the whole batch (a rank's offset included).
std::string Field(int64_t datum, const char* field) { return absl::StrCat("batch[", datum, "].", field); }

absl::Status CheckLength(int64_t datum, const char* field, size_t n, size_t tokens) {
  if (n == tokens) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(Field(datum, field), ": length (", n, ") must equal the length of tokens (", tokens, ")"));
}

absl::Status CheckIds(int64_t datum, const char* field, const std::vector<int64_t>& ids, int64_t vocab_size) {
  for (size_t t = 0; t < ids.size(); ++t) {
    if (ids[t] < 0 || ids[t] >= vocab_size)
      return absl::InvalidArgumentError(absl::StrCat(Field(datum, field), "[", t, "] (", ids[t],
                                                     ") must be in [0, ", vocab_size, "), the model's vocabulary"));
  }
  return absl::OkStatus();
}

absl::Status CheckFinite(int64_t datum, const char* field, const std::vector<float>& values, bool non_negative,
                         bool bounded) {
  for (size_t t = 0; t < values.size(); ++t) {
    if (!std::isfinite(values[t]))
      return absl::InvalidArgumentError(absl::StrCat(Field(datum, field), "[", t, "] (", values[t], ") must be finite"));
    if (non_negative && values[t] < 0)
      return absl::InvalidArgumentError(absl::StrCat(Field(datum, field), "[", t, "] (", values[t], ") must be >= 0"));
    if (bounded && std::abs(values[t]) > kMaxLossInput)
      return absl::InvalidArgumentError(absl::StrCat(Field(datum, field), "[", t, "] (", values[t],
                                                     ") must be within [-1e6, 1e6] (scale the rewards down)"));
  }
  return absl::OkStatus();
}

torch::Tensor Ratio(const torch::Tensor& logp, const torch::Tensor& sampler_logprobs) {
  return torch::exp(torch::clamp(logp - sampler_logprobs, -kMaxLogRatio, kMaxLogRatio));  // (S,)
}

}  // namespace

absl::StatusOr<LossKind> ParseLossKind(const std::string& name) {
  if (name == "cross_entropy") return LossKind::kCrossEntropy;
  if (name == "importance_sampling") return LossKind::kImportanceSampling;
  if (name == "ppo") return LossKind::kPpo;
  return absl::InvalidArgumentError(
      absl::StrCat("loss.kind '", name, "' is not a known loss: cross_entropy | importance_sampling | ppo"));
}

std::string LossKindName(LossKind kind) {
  switch (kind) {
    case LossKind::kUnspecified: return "unspecified";
    case LossKind::kCrossEntropy: return "cross_entropy";
    case LossKind::kImportanceSampling: return "importance_sampling";
    case LossKind::kPpo: return "ppo";
  }
  return absl::StrCat("unknown(", static_cast<int>(kind), ")");
}

absl::Status LossSpec::Validate() const {
  switch (kind) {
    case LossKind::kCrossEntropy:
    case LossKind::kImportanceSampling:
      return absl::OkStatus();
    case LossKind::kPpo:
      if (!(clip_low > 0 && clip_low < 1))
        return absl::InvalidArgumentError(absl::StrCat("loss.clip_low (", clip_low, ") must be in (0, 1)"));
      if (!(clip_high > 0 && clip_high <= 1e6))
        return absl::InvalidArgumentError(absl::StrCat("loss.clip_high (", clip_high, ") must be in (0, 1e6]"));
      return absl::OkStatus();
    case LossKind::kUnspecified:
      break;
  }
  return absl::InvalidArgumentError(absl::StrCat("loss.kind (", LossKindName(kind),
                                                 ") is not a known loss: cross_entropy | importance_sampling | ppo"));
}

absl::Status ValidateDatums(const std::vector<Datum>& batch, const LossSpec* spec, int64_t vocab_size,
                            int64_t max_tokens, int64_t datum_offset) {
  if (spec != nullptr) {
    if (absl::Status s = spec->Validate(); !s.ok()) return s;
  }
  const bool rl = spec != nullptr && spec->kind != LossKind::kCrossEntropy;
  for (size_t j = 0; j < batch.size(); ++j) {
    const Datum& d = batch[j];
    const int64_t i = datum_offset + static_cast<int64_t>(j);  // the datum's index in the whole batch
    const size_t S = d.tokens.size();
    if (S == 0) return absl::InvalidArgumentError(absl::StrCat(Field(i, "tokens"), ": empty; a datum needs >= 1 token"));
    if (static_cast<int64_t>(S) > max_tokens)
      return absl::InvalidArgumentError(absl::StrCat(Field(i, "tokens"), ": length (", S, ") must be <= ", max_tokens,
                                                     ", the longest sequence the model takes"));
    if (absl::Status s = CheckIds(i, "tokens", d.tokens, vocab_size); !s.ok()) return s;
    if (absl::Status s = CheckLength(i, "target_tokens", d.target_tokens.size(), S); !s.ok()) return s;
    if (absl::Status s = CheckIds(i, "target_tokens", d.target_tokens, vocab_size); !s.ok()) return s;
    // Optional arrays: when present, one entry per token and finite.
    struct Optional {
      const char* field;
      const std::vector<float>& values;
      bool required;
      bool non_negative;
      bool bounded;  // |value| <= kMaxLossInput
    };
    const Optional optional[] = {{"weights", d.weights, false, true, true},
                                 {"sampler_logprobs", d.sampler_logprobs, rl, false, false},
                                 {"advantages", d.advantages, rl, false, true}};
    for (const Optional& o : optional) {
      if (o.values.empty()) {
        if (o.required)
          return absl::InvalidArgumentError(
              absl::StrCat(Field(i, o.field), ": required by loss ", LossKindName(spec->kind), " (empty)"));
        continue;
      }
      if (absl::Status s = CheckLength(i, o.field, o.values.size(), S); !s.ok()) return s;
      if (absl::Status s = CheckFinite(i, o.field, o.values, o.non_negative, o.bounded); !s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateBatch(const std::vector<Datum>& batch, const LossSpec* spec, int64_t vocab_size,
                           int64_t max_tokens, int64_t datum_offset) {
  if (spec != nullptr) {
    if (absl::Status s = spec->Validate(); !s.ok()) return s;
  }
  if (batch.empty()) return absl::InvalidArgumentError("batch: empty; at least one datum is required");
  if (absl::Status s = ValidateDatums(batch, spec, vocab_size, max_tokens, datum_offset); !s.ok()) return s;
  if (spec != nullptr && !(BatchWeightSum(batch) > 0))
    return absl::InvalidArgumentError("batch: the weights sum to 0 over the batch; at least one token needs weight > 0");
  return absl::OkStatus();
}

double BatchWeightSum(const std::vector<Datum>& batch) {
  double sum = 0;
  for (const Datum& d : batch) {
    if (d.weights.empty()) {
      sum += static_cast<double>(d.tokens.size());
    } else {
      for (float w : d.weights) sum += w;
    }
  }
  return sum;
}

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
