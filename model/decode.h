// Decoding with a KV cache: the model family's inference path beside the training forward
// (CausalLMImpl::Hidden, which this file leaves untouched). The sampler (engine/sampler.h) is
// its user.
//
// The same modules and the same math as the training forward: each layer's input norm, q/k/v
// projections (Qwen2 biases), q/k norm (Qwen3) and RoPE, o_proj with its residual, then
// DecoderLayerImpl::MlpBlock; only attention differs. Prefill writes the keys and values (after
// RoPE) of positions [0, P) into the cache and runs the backend's causal attention as training
// does; a decode step writes one position per row at the row's own index and attends to that
// row's visible entries through a key mask (SDPA, GQA heads repeated), so rows of different
// lengths decode in one batch.
// No autograd (everything runs under NoGradGuard). Thread safety: one thread per model.
#pragma once

#include <cstdint>
#include <vector>

#include <torch/types.h>

#include "model/causal_lm.h"

namespace odyssey::model {

// One attention layer's keys and values after RoPE, (B, Hkv, T, D) each, in the params' dtype.
// Row b's valid entries are [0, length_b); later ones are scratch (right padding of a prompt,
// positions not decoded yet).
struct LayerKv {
  torch::Tensor k;
  torch::Tensor v;
};

// Every decoder layer's LayerKv for B rows of up to `capacity` (T) positions.
struct KvCache {
  std::vector<LayerKv> layers;
  int64_t capacity = 0;
};

// Zeros (B, Hkv, T, D) per layer in the params' dtype and device.
KvCache NewKvCache(CausalLMImpl& model, int64_t B, int64_t T);

// Right-padded prompts `ids` (B, P), P <= T, run causally: fills cache entries [0, P) and returns
// the final normed hidden states (B, P, hidden). Padding comes after every real token, so it
// never reaches one: row b's next-token state is at its prompt length - 1. `cache` may hold
// views into a larger cache (a row's slice): they are written through.
torch::Tensor Prefill(CausalLMImpl& model, const torch::Tensor& ids, KvCache& cache);

// One token per row, `ids` (B, 1), at `positions` (B,) int64 (its RoPE position and its cache
// index); row b attends to its cache entries [0, positions[b]]. Returns (B, 1, hidden).
// REQUIRES: positions[b] < T.
torch::Tensor Decode(CausalLMImpl& model, const torch::Tensor& ids, const torch::Tensor& positions, KvCache& cache);

}  // namespace odyssey::model
