// RL losses over per-token logprobs: the loss core of RL sessions (DESIGN.md section 2, issue 5).
//
// A Datum (engine/rl_datum.h, with LossSpec and the batch's validation) is one sequence of an
// orchestrator's batch, already tokenized, with per-token loss inputs (the shape of the
// primitives RL orchestrators use). The trainer turns each datum into
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
// Validation (engine/rl_datum.h) runs before any compute, so a bad batch changes nothing; its
// bounds on weights and advantages (|x| <= 1e6), with the clamped log ratio, keep every term,
// the loss and the gradients finite in fp32.
// Thread safety: free functions over their arguments; no shared state.
#pragma once

#include <cstdint>

#include <torch/types.h>

#include "engine/rl_datum.h"

namespace odyssey::engine {

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
