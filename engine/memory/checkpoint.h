// Activation checkpointing: full-block recompute through a custom autograd Function, and the
// tiled MLP and tiled LM-head + cross-entropy Functions. libtorch C++ has no checkpoint
// helper, so these are torch::autograd::Function subclasses with static forward/backward.
//
// Each keeps from forward only what it cannot cheaply recompute (a block's input; a tile
// Function's input) and reruns the math per block / per tile in backward, accumulating the
// parameters' gradients there through a nested backward call.
// Thread safety: one thread at a time.
#pragma once

#include <functional>

#include <torch/types.h>

#include "engine/memory/saved_inputs.h"
#include "model/layers.h"

namespace odyssey::engine::memory {

// A block x -> y. `recompute` is false on the first forward (run without grad; anything
// allocated for backward is waste) and true when backward reruns it with grad.
using BlockBody = std::function<torch::Tensor(const torch::Tensor& x, bool recompute)>;

// y = body(x), saving only x (in `store` slot `slot`); backward reruns body(x, true) and
// back-propagates through it, then calls `after_backward` (if any): the block's parameters
// have their gradients from this backward by then. With grad disabled this is body(x, false).
// `label` names the block's phases in a profile ("<label> forward", "... recompute", "... backward").
// With `regenerate` (it returns x's values again, without a graph) nothing is saved: the slot is
// marked regenerated and backward calls it instead (the stack's first block: the embedding).
// `prefetch_below` false: backward takes x without starting the copy of slot - 1 back from the
// host; the body starts it (SavedInputs::Prefetch) when it is due.
torch::Tensor CheckpointBlock(const torch::Tensor& x, BlockBody body, SavedInputs* store, int64_t slot,
                              std::shared_ptr<void> keepalive = nullptr, std::function<void()> after_backward = nullptr,
                              const std::string& label = "block", std::function<torch::Tensor()> regenerate = nullptr,
                              bool prefetch_below = true);

// A tensor of `like`'s shape, dtype and device whose storage is one element (every stride 0):
// the stand-in for a block output whose value is never read, only its shape and graph (a nested
// group's output in its recompute). Its elements are uninitialized.
torch::Tensor ShapeOnly(const torch::Tensor& like);

// layer->MlpBlock(h) over tiles of `tile_tokens` positions: no (S, intermediate) tensor at
// full S, in forward or backward. h (B, S, H) -> (B, S, H).
// output_unused: the caller only back-propagates through the result (a checkpointed layer's
// recompute, where the MLP output is the layer's output): the forward tiles are skipped and
// an uninitialized tensor returned, since the backward recomputes each tile anyway. That
// saves one MLP forward per layer per step.
torch::Tensor TiledMlpBlock(model::DecoderLayer layer, const torch::Tensor& h, int64_t tile_tokens,
                            bool output_unused = false);

// Sum over positions of -log softmax(hidden @ W^T)[label] * mask, in tiles of `tile_tokens`
// positions: no (S, vocab) logits; fp32 only inside a tile. hidden (B, S, H), W (V, H),
// labels (B, S) int64, mask (B, S) float. Returns an fp32 scalar.
torch::Tensor TiledCrossEntropySum(const torch::Tensor& hidden, const torch::Tensor& weight,
                                   const torch::Tensor& labels, const torch::Tensor& mask, int64_t tile_tokens);

// log softmax(hidden @ W^T)[label] at every position, fp32 (B, S), differentiable w.r.t.
// hidden and W for any upstream gradient, in tiles of `tile_tokens` positions: the per-token
// logprobs RL losses need, without (S, vocab) logits.
torch::Tensor TiledTokenLogprobs(const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& labels,
                                 int64_t tile_tokens);

}  // namespace odyssey::engine::memory
