// RL losses over per-token logprobs: the loss core of RL sessions (DESIGN.md section 2, issue 5).
//
// A Datum is one sequence of an orchestrator's batch, already tokenized, with per-token loss
// inputs (the shape of the primitives RL orchestrators use). The trainer turns each datum into
// the model's fp32 logprobs of its target tokens, logp (S,), and the functions here turn those
// into a loss:
//
//   cross_entropy        -sum(w * logp) / W
//   importance_sampling  -sum(w * r * A) / W                                  r = exp(logp - q)
//   ppo                  -sum(w * min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)) / W
//
// where q is the sampler's logprob of the same token (a constant: no gradient flows into it), A
// the advantage and w the weight (loss mask). log r is clamped to [-20, 20] before exp, so a
// wild sampler logprob cannot overflow r into NaN gradients (beyond it the token gets no ratio
// gradient), and tokens of weight 0 are selected out, never multiplied. Normalization, the same for every loss: W is the sum
// of the weights over the whole batch (every datum, every token), so a batch's loss is a weighted
// mean over its tokens and does not depend on how the batch is split into datums. Gradients of
// successive ForwardBackward calls add up, each call normalized by its own W. A data-parallel
// rank holds a slice of the batch and normalizes by the whole batch's W (engine/trainer.h
// RlShard), so the ranks' terms add up to the batch loss.
//
// The trainer-vs-sampler mismatch (mean and max |logp - q| over the tokens with w > 0 of the
// datums that carry sampler logprobs) says how far the inference engine's numerics are from the
// trainer's; large values make the importance ratios meaningless.
//
// Validation (ValidateBatch) runs before any compute, so a bad batch changes nothing; its
// INVALID_ARGUMENT messages name the field with the datum (and token) index and the rule, e.g.
// "batch[2].advantages[5] (nan) must be finite". Weights and advantages are also bounded to
// |x| <= 1e6, which with the clamped log ratio keeps every term, the loss and the gradients
// finite in fp32.
// Thread safety: free functions over their arguments; no shared state.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <torch/types.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace odyssey::engine {

// One sequence of a batch. All per-token arrays have one entry per entry of `tokens` (S).
struct Datum {
  // Token ids fed to the model, positions 0..S-1 (S >= 1, ids in [0, vocab)).
  std::vector<int64_t> tokens;
  // The token each position predicts (usually tokens shifted by one plus the next token):
  // target_tokens[i] is scored against the model's output at position i. Ids in [0, vocab).
  std::vector<int64_t> target_tokens;
  // Loss weight per token (finite, in [0, 1e6]; 0 = not in the loss, e.g. prompt tokens). Empty = all 1.
  std::vector<float> weights;
  // The sampler's (inference engine's) logprob of each target token, finite. Empty = absent:
  // allowed for cross_entropy (no mismatch metric for this datum), required by the others.
  std::vector<float> sampler_logprobs;
  // Advantage per token, finite, |A| <= 1e6. Empty = absent: required by importance_sampling and ppo,
  // ignored by cross_entropy.
  std::vector<float> advantages;
};

enum class LossKind : int {
  kUnspecified = 0,  // invalid: a request must choose
  kCrossEntropy = 1,
  kImportanceSampling = 2,
  kPpo = 3,
};

// "cross_entropy" | "importance_sampling" | "ppo"; anything else is INVALID_ARGUMENT naming it.
absl::StatusOr<LossKind> ParseLossKind(const std::string& name);
std::string LossKindName(LossKind kind);  // "unspecified" / "unknown(N)" for invalid values

struct LossSpec {
  LossKind kind = LossKind::kCrossEntropy;
  // PPO's clip range around ratio 1: r is clipped to [1 - clip_low, 1 + clip_high]. Asymmetric
  // values (clip_high > clip_low, "clip higher") are allowed. Only ppo reads them.
  double clip_low = 0.2;   // eps_low, in (0, 1)
  double clip_high = 0.2;  // eps_high, in (0, 1e6]
  // Checks kind and (for ppo) the clip range; messages name the field ("loss.clip_low (1.5) must
  // be in (0, 1)").
  absl::Status Validate() const;
};

// Checks a batch before anything runs: non-empty; every datum has tokens (at most
// `max_tokens`), ids in [0, vocab_size), per-token arrays of the tokens' length, finite values,
// weights >= 0 summing to > 0 over the batch (when `spec` is given), and the inputs the loss
// needs. `spec` == nullptr validates for Forward (tokens and target_tokens only; the other
// arrays are checked only when present). `datum_offset` is the index of batch[0] in the whole
// batch when `batch` is one data-parallel rank's slice: messages name datum i as
// "batch[datum_offset + i]", its index in the request the user sent.
absl::Status ValidateBatch(const std::vector<Datum>& batch, const LossSpec* spec, int64_t vocab_size,
                           int64_t max_tokens, int64_t datum_offset = 0);

// ValidateBatch without its two whole-batch rules (non-empty, weights summing to > 0): `spec`
// and every datum. For a data-parallel rank's slice, which may be empty or weigh 0 while the
// whole batch does not; the caller checks the whole batch's W.
absl::Status ValidateDatums(const std::vector<Datum>& batch, const LossSpec* spec, int64_t vocab_size,
                            int64_t max_tokens, int64_t datum_offset = 0);

// Sum of the weights over the batch (W above). REQUIRES: a validated batch.
double BatchWeightSum(const std::vector<Datum>& batch);

// One datum's loss inputs as fp32 tensors on `device`, each (S,). Absent arrays are undefined
// tensors, except weights (ones).
struct DatumTensors {
  torch::Tensor weights;           // (S,) fp32
  torch::Tensor sampler_logprobs;  // (S,) fp32 or undefined
  torch::Tensor advantages;        // (S,) fp32 or undefined
};
DatumTensors ToTensors(const Datum& datum, torch::Device device);

// The datum's term of the loss before normalization: for cross_entropy -sum(w * logp), etc.
// (a differentiable fp32 scalar; divide by W for the batch loss).
// logp (S,) fp32: the model's logprobs of the target tokens.
// REQUIRES: a validated spec; the tensors the loss reads are defined and (S,).
torch::Tensor DatumLossSum(const torch::Tensor& logp, const DatumTensors& in, const LossSpec& spec);

// Tokens with w > 0 whose gradient PPO's clip removed: A > 0 and r > 1 + clip_high, or A < 0 and
// r < 1 - clip_low. 0 for the other losses.
int64_t PpoClippedTokens(const torch::Tensor& logp, const DatumTensors& in, const LossSpec& spec);

// Trainer-vs-sampler logprob mismatch, accumulated datum by datum.
struct Mismatch {
  double sum_abs = 0;   // sum of |logp - q| over counted tokens
  double max_abs = 0;   // max of |logp - q| over counted tokens (0 when none)
  int64_t tokens = 0;   // tokens counted: w > 0 in datums with sampler logprobs
  double mean_abs() const { return tokens > 0 ? sum_abs / static_cast<double>(tokens) : 0.0; }
  // Adds one datum (no-op when it has no sampler logprobs). logp (S,) fp32.
  void Add(const torch::Tensor& logp, const DatumTensors& in);
};

}  // namespace odyssey::engine
