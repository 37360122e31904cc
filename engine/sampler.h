// The sampler: autoregressive decoding on a model's current weights with a per-layer KV cache
// (model/decode.h: Prefill / Decode), for RL sessions' Sample calls (worker/rl_session.h).
//
// Each prompt is prefilled once (one row at a time: the prompt's own length, no padding; its
// cache rows copied to its other samples), then every sequence advances one token per step in
// one batched decode. Per step: logits (rows, vocab) in fp32; temperature 0 takes the argmax;
// otherwise logits / temperature, then top-k (keep the k largest), then top-p (keep the
// smallest prefix of the sorted distribution whose mass reaches top_p, at least one token),
// and one draw per row from a CPU generator seeded with `seed`, rows in order: the same request
// on the same weights gives the same tokens on any device that computes the same logits.
// A sequence stops after a stop token or max_tokens; finished rows ride along until all stop.
//
// Memory: the cache holds rows x (longest prompt + max_tokens) positions per layer; the
// caller bounds that by the positions its memory was planned for (SamplerLimits).
// Thread safety: one call at a time per model.
#pragma once

#include <cstdint>

#include <torch/types.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/sampling.h"
#include "model/causal_lm.h"

namespace odyssey::engine {

struct SamplerLimits {
  // rows (prompts x num_samples) x (longest prompt + max_tokens) must not exceed this; 0 = no
  // limit. An RL session passes spec.data.seq_len x spec.data.batch_size.
  int64_t max_positions = 0;
};

// INVALID_ARGUMENT naming the field ("prompts[2][5]", "params.top_p", "num_samples") and the
// rule, for a model of `vocab` tokens and `max_position_embeddings`; OK otherwise.
absl::Status ValidateSample(const SampleSpec& spec, int64_t vocab, int64_t max_position_embeddings,
                            const SamplerLimits& limits);

// Validates, then samples. RESOURCE_EXHAUSTED when the device runs out of memory, INTERNAL for
// another libtorch error; the model is unchanged either way.
absl::StatusOr<SampleResult> Sample(model::CausalLM& model, const SampleSpec& spec, const SamplerLimits& limits);

// One decoding step's choice for each row of `logits` (R, V) fp32: the argmax when temperature
// is 0, else a draw from the temperature / top-k / top-p distribution with `generator` (CPU).
// Returns (R,) int64 on the CPU. Exposed for tests of the filters.
torch::Tensor ChooseTokens(const torch::Tensor& logits, const SampleSpec& spec, at::Generator& generator);

}  // namespace odyssey::engine
