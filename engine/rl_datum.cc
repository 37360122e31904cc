#include "engine/rl_datum.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace odyssey::engine {
namespace {

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
                            int64_t max_tokens, int64_t datum_offset, bool allow_empty) {
  if (spec != nullptr) {
    if (absl::Status s = spec->Validate(); !s.ok()) return s;
  }
  if (batch.empty() && !allow_empty) return absl::InvalidArgumentError("batch: empty; at least one datum is required");
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
  if (absl::Status s = ValidateDatums(batch, spec, vocab_size, max_tokens, datum_offset, /*allow_empty=*/false);
      !s.ok())
    return s;
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

}  // namespace odyssey::engine
