// Sampling requests and results as plain C++ (no libtorch, no protobuf), as engine/rl_datum.h is
// for batches: the worker's proto half (worker/rl_calls.cc) fills SampleSpec from a
// TrainingService Sample call and reads SampleResult back; engine/sampler.h validates and runs
// them on a model. Plain structs; no shared state.
#pragma once

#include <cstdint>
#include <vector>

namespace odyssey::engine {

// What to sample. Every rule is checked by engine::ValidateSample (sampler.h), naming the
// field as the TrainingService names it.
struct SampleSpec {
  // Token ids of each prompt (non-empty, ids in [0, vocab)).
  std::vector<std::vector<int64_t>> prompts;
  int64_t num_samples = 1;    // sequences per prompt, >= 1
  int64_t max_tokens = 0;     // new tokens per sequence, >= 1
  double temperature = 1.0;   // finite, >= 0; 0 = greedy (argmax; top_p, top_k and seed unused)
  double top_p = 1.0;         // nucleus mass in (0, 1]; 1 = off
  int64_t top_k = 0;          // >= 0; 0 = off (the whole vocabulary)
  std::vector<int64_t> stop_tokens;  // ids in [0, vocab); a sequence ends after emitting one
  uint64_t seed = 0;          // the sampling stream: one seed, one result
};

struct SampledSequence {
  int64_t prompt_index = 0;      // which prompt (sequences are prompt-major: i * num_samples + j)
  std::vector<int64_t> tokens;   // the new tokens, a stop token included when one ended it
  // Per token, the model's log-probability of it (log-softmax of the logits at temperature 1,
  // before top-k / top-p): what Forward returns for the same token, the sampler logprob the
  // importance-sampling and PPO losses compare with.
  std::vector<float> logprobs;
  bool stopped = false;          // true: ended by a stop token; false: by max_tokens
};

struct SampleResult {
  std::vector<SampledSequence> sequences;
  int64_t tokens = 0;    // new tokens sampled, all sequences
  double seconds = 0;    // compute time
};

}  // namespace odyssey::engine
