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
//
// The hybrid family (model/hybrid.h) decodes through the same calls: a KDA layer keeps its
// recurrent state and the normed input of its last conv_kernel - 1 tokens (a decode step runs
// KdaAttentionImpl::TileHeads on those tokens plus the new one, from the state); a DSA layer keeps
// its keys and values (no RoPE) and its indexer's per-token keys and pool gates, and pools each 4
// as they complete (kernels::KeyPool4); a decode step selects the row's top pools among its
// complete ones (kernels::IndexerTopK at the row's position), adds the tail and attends over them
// (kernels::SparseAttentionForward) — the training forward's selection for that query. Prefill
// runs the layers' training forward on the prompts (no padding for this family: a row's state
// would run past its end, so every row of one Prefill call is P tokens long).
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
  torch::Tensor k;  // dense attention and DSA
  torch::Tensor v;
  // KDA: the recurrent state after the last token (B, H, K, K) fp32, and the layer's normed input
  // of the last conv_kernel - 1 tokens (B, kernel - 1, hidden), zeros before the first token.
  torch::Tensor state, conv_x;
  // DSA's indexer: each token's key k^I and pool gate z (B, T, DI), and the pooled keys of the
  // complete pools (B, T / 4, DI).
  torch::Tensor index_k, index_z, pooled;
};

// Every decoder layer's LayerKv for B rows of up to `capacity` (T) positions.
struct KvCache {
  std::vector<LayerKv> layers;
  int64_t capacity = 0;
};

// Zeros (B, Hkv, T, D) per layer in the params' dtype and device (the hybrid family's layers:
// their own tensors above).
KvCache NewKvCache(CausalLMImpl& model, int64_t B, int64_t T);
// Rows [first, first + count) of every tensor of `cache`, as views (writes go through).
KvCache CacheRows(KvCache& cache, int64_t first, int64_t count);
// Copies row `from` of every tensor of `cache` into row `to`.
void CopyCacheRow(KvCache& cache, int64_t from, int64_t to);

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
