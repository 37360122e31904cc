#include "engine/memory/strategy.h"

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "engine/loss.h"
#include "engine/memory/checkpoint.h"
#include "engine/profiler.h"
#include "model/hybrid.h"
#include "model/moe.h"

namespace odyssey::engine::memory {

MemoryStack::MemoryStack(const planner::MemoryStrategy& strategy, int64_t num_layers)
    : strategy_(strategy), num_layers_(num_layers) {
  if (strategy_.offload) pool_ = std::make_unique<HostPool>(strategy_.host_budget_bytes, /*pinned=*/true);
  saved_ = std::make_unique<SavedInputs>(pool_.get(), strategy_.device_resident);
}

absl::StatusOr<std::unique_ptr<MemoryStack>> MemoryStack::Create(const planner::MemoryStrategy& strategy,
                                                                 int64_t num_layers) {
  if (absl::Status s = strategy.Validate(); !s.ok()) return s;
  return std::unique_ptr<MemoryStack>(new MemoryStack(strategy, num_layers));
}

int64_t MemoryStack::NumCheckpoints() const { return strategy_.NumCheckpoints(num_layers_); }

absl::Status MemoryStack::Prepare(int64_t B, int64_t S, int64_t hidden, torch::Dtype dtype) {
  if (!pool_) return absl::OkStatus();
  const int64_t offloaded = std::max<int64_t>(0, NumCheckpoints() - strategy_.device_resident);
  // Slot 0, the stack's input, is recomputed from the ids where the model can (Runner): the
  // pool keeps none for it. (A runner called without LayerContext::stack_input saves it, and the
  // pool allocates that slot then.)
  for (int64_t slot = 1; slot < offloaded; ++slot) {
    absl::StatusOr<torch::Tensor> t = pool_->Slot(slot, B * S * hidden, dtype);
    if (!t.ok()) return t.status();
  }
  return absl::OkStatus();
}

torch::Tensor MemoryStack::RunLayer(model::DecoderLayer layer, const torch::Tensor& h,
                                    const model::LayerContext& ctx, bool output_unused, bool replay, bool keep) {
  // keep_selection: a DSA layer's first forward keeps its pool selections, its recomputes reuse them.
  using Mode = model::DsaAttentionImpl::SelectionMode;
  model::DsaSelectionScope selection(strategy_.keep_selection && layer->dsa && (replay || keep) ? layer->dsa.get()
                                                                                                : nullptr,
                                     replay ? Mode::kReplay : Mode::kRecord);
  torch::Tensor a = layer->AttentionBlock(h, ctx);  // (B, S, H)
  if (layer->moe) {
    // The experts tile themselves at the MLP's tile (model/moe.h); a recompute reuses the
    // routing the forward decided.
    layer->moe->set_tile_tokens(strategy_.mlp_tile);
    model::MoePassScope pass(layer->moe.get(), replay ? model::RoutingMode::kReplay : model::RoutingMode::kDecide,
                             output_unused);
    return layer->MlpBlock(a);
  }
  return strategy_.mlp_tile > 0 ? TiledMlpBlock(layer, a, strategy_.mlp_tile, output_unused) : layer->MlpBlock(a);
}

model::LayerStackRunner MemoryStack::Runner() {
  return [this](const std::vector<model::DecoderLayer>& layers, const torch::Tensor& h0,
                const model::LayerContext& ctx) -> torch::Tensor {
    torch::Tensor h = h0;
    const int64_t L = static_cast<int64_t>(layers.size());
    if (strategy_.recompute == planner::Recompute::kNone || !torch::GradMode::is_enabled()) {
      for (int64_t i = 0; i < L; ++i) {
        ProfilePhase phase(absl::StrCat("layer ", i, " forward"));
        if (hooks_.before_forward) hooks_.before_forward(i, 1);
        h = RunLayer(layers[static_cast<size_t>(i)], h, ctx);
        if (hooks_.after_forward) hooks_.after_forward(i, 1, torch::GradMode::is_enabled());
      }
      return h;
    }
    const int64_t k = strategy_.recompute == planner::Recompute::kLayer ? 1 : strategy_.every_k;
    const int64_t groups = (L + k - 1) / k;
    saved_->BeginStep(groups);
    stash_.Clear();  // nothing a failed earlier step recorded survives into this forward
    for (const auto& layer : layers) {
      if (layer->dsa) layer->dsa.ptr()->ClearSelections();  // nor what its DSA layers kept
    }
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t first = g * k, count = std::min(k, L - first);
      std::vector<model::DecoderLayer> group(layers.begin() + first, layers.begin() + first + count);
      BlockBody body = [this, group, ctx, first, count, g](const torch::Tensor& x, bool recompute) {
        if (recompute && hooks_.before_recompute) hooks_.before_recompute(first, count);
        torch::Tensor y = x;
        if (strategy_.keep_attention) {  // recompute == "layer": one layer per group
          stash_.Begin(first, recompute ? AttentionStash::Mode::kReplay : AttentionStash::Mode::kRecord);
          y = RunLayer(group[0], y, ctx, /*output_unused=*/recompute, /*replay=*/recompute);
          stash_.End();
          return y;
        }
        if (!recompute) {
          for (const auto& layer : group) y = RunLayer(layer, y, ctx, false, false, /*keep=*/true);
          return y;
        }
        // Recomputing for backward: the block's output value is never read, only its graph.
        if (group.size() == 1) return RunLayer(group[0], y, ctx, /*output_unused=*/true, /*replay=*/true);
        // Nested: while this group's backward runs, its layers' inputs stay on the device and
        // each layer is recomputed again on its own, so only one layer's activations live.
        auto inner = std::make_shared<SavedInputs>(nullptr, 0);
        inner->BeginStep(static_cast<int64_t>(group.size()));
        for (size_t j = 0; j < group.size(); ++j) {
          model::DecoderLayer layer = group[j];
          const bool last = j + 1 == group.size(), bottom = j == 0;
          y = CheckpointBlock(
              y,
              [this, layer, ctx, last, bottom, g](const torch::Tensor& xi, bool inner_recompute) {
                // The group below's input comes back from the host while this group's bottom
                // layer runs its backward (the last of the group's), not from the group's start:
                // the group's upper layers (with a DSA layer on top, hybrid-3b's peak) run
                // without it beside them.
                if (bottom && inner_recompute && g > 0) saved_->Prefetch(g - 1);
                // The last layer's output is the group's, whose value is never read: its first
                // inner pass only has to save xi, so the layer does not run. A whole layer
                // forward saved per group: with a DSA layer last, its indexer's selection too.
                // The stand-in for its output, the root of the group's graph while the group's
                // backward runs, holds no (T, hidden): ShapeOnly's storage is one element.
                if (last && !inner_recompute) return ShapeOnly(xi);
                // Both inner passes replay the routing of the group's first forward.
                return RunLayer(layer, xi, ctx, /*output_unused=*/inner_recompute, /*replay=*/true);
              },
              inner.get(), static_cast<int64_t>(j), inner, nullptr, absl::StrCat("layer ", first + static_cast<int64_t>(j)));
        }
        return y;
      };
      std::function<void()> after_backward;
      if (hooks_.after_backward) after_backward = [this, first, count] { hooks_.after_backward(first, count); };
      if (hooks_.before_forward) hooks_.before_forward(first, count);
      // The first group's input is the embedding of the ids: recomputed in its backward (a lookup),
      // not kept on the device or in the pool.
      h = CheckpointBlock(h, std::move(body), saved_.get(), g, nullptr, std::move(after_backward),
                          count == 1 ? absl::StrCat("layer ", first) : absl::StrCat("layers ", first, "-", first + count - 1),
                          g == 0 ? ctx.stack_input : nullptr, /*prefetch_below=*/count == 1);
      if (hooks_.after_forward) hooks_.after_forward(first, count, /*kept=*/false);
    }
    return h;
  };
}

torch::Tensor MemoryStack::LossSum(const torch::Tensor& hidden, const torch::Tensor& head_weight,
                                   const torch::Tensor& labels, const torch::Tensor& mask) {
  if (strategy_.loss_tile > 0) return TiledCrossEntropySum(hidden, head_weight, labels, mask, strategy_.loss_tile);
  return MaskedCrossEntropySum(hidden, head_weight, labels, mask);
}

torch::Tensor MemoryStack::TokenLogprobs(const torch::Tensor& hidden, const torch::Tensor& head_weight,
                                         const torch::Tensor& labels) {
  if (strategy_.loss_tile > 0) return TiledTokenLogprobs(hidden, head_weight, labels, strategy_.loss_tile);
  return engine::TokenLogprobs(hidden, head_weight, labels);
}

}  // namespace odyssey::engine::memory
