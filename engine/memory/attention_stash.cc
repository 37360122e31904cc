#include "engine/memory/attention_stash.h"

#include <torch/torch.h>

namespace odyssey::engine::memory {

void AttentionStash::Begin(int64_t layer, Mode mode) {
  mode_ = mode;
  layer_ = layer;
  cursor_ = 0;
  if (static_cast<int64_t>(layers_.size()) <= layer) layers_.resize(layer + 1);
  if (mode == Mode::kRecord) layers_[layer].clear();
}

void AttentionStash::Record(Entry entry) { layers_[layer_].push_back(std::move(entry)); }

AttentionStash::Entry AttentionStash::Replay() {
  auto& entries = layers_[layer_];
  TORCH_CHECK(cursor_ < entries.size(), "attention stash: layer ", layer_, " has no record ", cursor_,
              " (the recompute made more attention calls than the first forward)");
  Entry e = std::move(entries[cursor_]);
  entries[cursor_] = Entry{};  // released once replayed
  ++cursor_;
  return e;
}

void AttentionStash::Clear() {
  layers_.clear();
  mode_ = Mode::kOff;
  cursor_ = 0;
}

int64_t AttentionStash::bytes() const {
  int64_t total = 0;
  for (const auto& layer : layers_) {
    for (const auto& e : layer) {
      if (e.out.defined()) total += e.out.nbytes();
      if (e.stats.lse.defined()) total += e.stats.lse.nbytes();
    }
  }
  return total;
}

namespace {

struct ReplayState : torch::CustomClassHolder {
  std::shared_ptr<const kernels::AttentionBackend> kernel;
  AttentionStash::Entry entry;
  double scale = 0;
};

// Output = the recorded output (no attention forward); backward = the kernel's backward.
class ReplayFunction : public torch::autograd::Function<ReplayFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor q, torch::Tensor k,
                               torch::Tensor v, c10::intrusive_ptr<ReplayState> state) {
    ctx->save_for_backward({q, k, v});
    torch::Tensor out = state->entry.out.detach();  // fresh autograd identity, same storage
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto state = c10::static_intrusive_pointer_cast<ReplayState>(ctx->saved_data["state"].toCapsule());
    auto saved = ctx->get_saved_variables();
    auto [dq, dk, dv] = state->kernel->CausalBackward(grads[0], saved[0], saved[1], saved[2], state->entry.out,
                                                      state->entry.stats, state->scale);
    ctx->saved_data.clear();  // the output and its statistics are not needed any more
    return {dq, dk, dv, torch::Tensor()};
  }
};

}  // namespace

torch::Tensor StashingAttention::Causal(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                        double scale) const {
  switch (stash_->mode()) {
    case AttentionStash::Mode::kRecord: {
      auto [out, stats] = inner_->CausalWithStats(q, k, v, scale);
      stash_->Record({out, stats});
      return out;
    }
    case AttentionStash::Mode::kReplay: {
      auto state = c10::make_intrusive<ReplayState>();
      state->kernel = inner_;
      state->entry = stash_->Replay();
      state->scale = scale;
      return ReplayFunction::apply(q, k, v, state);
    }
    case AttentionStash::Mode::kOff:
      break;
  }
  return inner_->Causal(q, k, v, scale);
}

}  // namespace odyssey::engine::memory
