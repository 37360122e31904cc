// The RL batch as plain C++: the Datum an orchestrator sends, the LossSpec that says which loss
// it feeds, and their validation. No libtorch and no protobuf, so that the worker's proto half
// (worker/rl_calls.cc) fills these structs from a TrainingCall once and the engine reads the
// same objects (tensors are built only inside the engine, engine/rl_loss.h ToTensors). The loss
// math over them is engine/rl_loss.h.
//
// Validation runs once, on the worker, before any compute (Trainer::ValidateRl calls
// ValidateDatums), so a bad batch changes nothing; its INVALID_ARGUMENT messages name the field
// with the datum (and token) index and the rule, e.g. "batch[2].advantages[5] (nan) must be
// finite". Weights and advantages are bounded to |x| <= 1e6, which with the loss's clamped log
// ratio keeps every term, the loss and the gradients finite in fp32.
// Thread safety: plain structs and free functions over their arguments; no shared state.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

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

// Checks a whole batch before anything runs: `spec` (when given), non-empty, every datum (see
// ValidateDatums), and weights summing to > 0 over the batch (when `spec` is given). `spec` ==
// nullptr validates for Forward (tokens and target_tokens only; the other arrays are checked
// only when present). `datum_offset` is the index of batch[0] in the whole batch when `batch`
// is one data-parallel rank's slice: messages name datum i as "batch[datum_offset + i]", its
// index in the request the user sent.
absl::Status ValidateBatch(const std::vector<Datum>& batch, const LossSpec* spec, int64_t vocab_size,
                           int64_t max_tokens, int64_t datum_offset = 0);

// ValidateBatch without the whole-batch weight rule, for a data-parallel rank's slice (which
// may weigh 0, or with `allow_empty` be empty, while the whole batch does not; the caller checks
// the whole batch's W): `spec` (when given), then non-empty unless `allow_empty`, then every
// datum: tokens (at most `max_tokens`), ids in [0, vocab_size), per-token arrays of the tokens'
// length, finite values, weights >= 0, and the inputs the loss needs.
absl::Status ValidateDatums(const std::vector<Datum>& batch, const LossSpec* spec, int64_t vocab_size,
                            int64_t max_tokens, int64_t datum_offset, bool allow_empty);

// Sum of the weights over the batch (W of engine/rl_loss.h), a datum without weights counting 1
// per token. REQUIRES: a validated batch.
double BatchWeightSum(const std::vector<Datum>& batch);

}  // namespace odyssey::engine
