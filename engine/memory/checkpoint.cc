#include "engine/memory/checkpoint.h"

#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/torch.h>

#include "engine/loss.h"
#include "engine/profiler.h"
#include "model/grad_sums.h"

namespace odyssey::engine::memory {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Drops the block's reference to its incoming gradient once the root of the block's graph has
// run (a post-hook of that node).
struct DropIncomingGradient : torch::autograd::FunctionPostHook {
  explicit DropIncomingGradient(std::weak_ptr<variable_list> held) : held(std::move(held)) {}
  variable_list operator()(const variable_list& outputs, const variable_list& /*inputs*/) override {
    // Reset, not erased: the list keeps its size for any reader.
    if (auto list = held.lock())
      for (torch::Tensor& g : *list) g = torch::Tensor();
    return outputs;
  }
  std::weak_ptr<variable_list> held;
};

// torch::autograd::backward({y}, {g}) that lets g go as soon as the root of y's graph has
// consumed it. torch::autograd::backward's callers and its own copies would keep g alive to the
// end of the whole backward; here the only reference outside the engine is `held`, which the
// root's post-hook resets. In a group of layers (nested checkpoints) the root is the top layer's
// block: the group's incoming gradient, one (T, hidden), is freed when that layer is done, not
// after the last layer below it (measured: hybrid-3b at 512K, every_k(2), peaked in the group's
// lower KDA layer ~1.4 of (T, hidden) above a layer-recompute fit). Dropping a reference is safe
// whatever the engine does: where it keeps its own, the gradient simply lives on.
void BackwardReleasingGradient(const torch::Tensor& y, torch::Tensor g) {
  TORCH_CHECK(y.requires_grad(), "checkpointed block: the recomputed output does not require grad");
  TORCH_CHECK(g.defined() && g.sizes() == y.sizes(), "checkpointed block: the incoming gradient's shape ",
              g.defined() ? g.sizes() : c10::IntArrayRef{}, " is not the output's ", y.sizes());
  torch::autograd::Edge root = torch::autograd::impl::gradient_edge(y);
  TORCH_CHECK(root.function, "checkpointed block: the recomputed output has no graph");
  auto held = std::make_shared<variable_list>(variable_list{std::move(g)});
  root.function->add_post_hook(std::make_unique<DropIncomingGradient>(held));
  torch::autograd::Engine::get_default_engine().execute({root}, *held, /*keep_graph=*/false,
                                                        /*create_graph=*/false, /*accumulate_grad=*/true);
}

// State a Function carries from forward to backward (as an IValue capsule).
struct BlockState : torch::CustomClassHolder {
  BlockBody body;
  SavedInputs* store = nullptr;
  int64_t slot = 0;
  std::shared_ptr<void> keepalive;  // e.g. an inner store that must outlive this block
  std::string label;                // "layer N" / "layers A-B": the profiler's phase names
  std::function<void()> after_backward;  // the block's gradients are in (MemoryStack's hook)
  std::function<torch::Tensor()> regenerate;  // x again, in place of the store's slot
  std::vector<int64_t> sizes;                 // x's, checked against what regenerate returns
  bool prefetch_below = true;                 // Take starts slot - 1's copy (else the body does)
};

class CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
 public:
  // The recomputed output roots the block's graph while its backward runs, and the engine reads
  // only its grad_fn and shape there, never its values: its memory (one (T, hidden) for a layer)
  // goes back now instead of after the backward. Not when anything else holds the storage (an op
  // that saved its output, a view): then the values may be read.
  static void ReleaseValues(const torch::Tensor& y) {
    if (!y.defined() || !y.has_storage() || y.storage().use_count() != 1) return;
    c10::StorageImpl* st = y.storage().unsafeGetStorageImpl();
    st->set_data_ptr_noswap(at::DataPtr(nullptr, y.device()));
    st->set_nbytes(0);
  }

  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, c10::intrusive_ptr<BlockState> state) {
    torch::Tensor y;
    {
      torch::NoGradGuard no_grad;
      y = state->body(x, /*recompute=*/false);
    }
    if (state->regenerate) {
      state->sizes = x.sizes().vec();
      state->store->Regenerated(state->slot);
    } else {
      absl::Status s = state->store->Save(state->slot, x.detach());
      TORCH_CHECK(s.ok(), std::string(s.message()));
    }
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return y;
  }

  // `grads` binds the autograd node's own list (CppNode::apply passes it as an lvalue), so
  // moving the incoming gradient out leaves no reference to it in the frames around this call.
  static variable_list backward(AutogradContext* ctx, variable_list& grads) {
    auto state = c10::static_intrusive_pointer_cast<BlockState>(ctx->saved_data["state"].toCapsule());
    torch::Tensor x;
    if (state->regenerate) {
      x = state->regenerate();
      TORCH_CHECK(x.sizes() == c10::IntArrayRef(state->sizes), "checkpointed block '", state->label,
                  "': its regenerated input has shape ", x.sizes(), ", the forward's had ",
                  c10::IntArrayRef(state->sizes));
    } else {
      x = state->store->Take(state->slot, state->prefetch_below);
    }
    x = x.detach().requires_grad_(true);
    torch::Tensor y;
    {
      ProfilePhase phase(state->label + " recompute");
      torch::AutoGradMode grad(true);
      y = state->body(x, /*recompute=*/true);
    }
    ReleaseValues(y);
    {
      ProfilePhase phase(state->label + " backward");
      BackwardReleasingGradient(y, std::move(grads[0]));
    }
    if (state->after_backward) state->after_backward();
    ctx->saved_data.clear();  // releases the body (and what it captured) as soon as possible
    return {x.grad(), torch::Tensor()};
  }
};

struct MlpState : torch::CustomClassHolder {
  model::DecoderLayer layer{nullptr};
  int64_t tile = 0;
  bool output_unused = false;
};

class TiledMlpFunction : public torch::autograd::Function<TiledMlpFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor h, c10::intrusive_ptr<MlpState> state) {
    torch::Tensor flat = h.reshape({-1, h.size(-1)});  // (N, H)
    torch::Tensor out = torch::empty_like(flat);
    if (!state->output_unused) {
      torch::NoGradGuard no_grad;
      for (int64_t t0 = 0; t0 < flat.size(0); t0 += state->tile) {
        const int64_t n = std::min(state->tile, flat.size(0) - t0);
        out.narrow(0, t0, n).copy_(state->layer->MlpBlock(flat.narrow(0, t0, n)));
      }
    }
    ctx->save_for_backward({h});
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return out.view(h.sizes());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto state = c10::static_intrusive_pointer_cast<MlpState>(ctx->saved_data["state"].toCapsule());
    torch::Tensor h = ctx->get_saved_variables()[0];
    torch::Tensor flat = h.reshape({-1, h.size(-1)});       // (N, H)
    torch::Tensor g = grads[0].reshape({-1, h.size(-1)});   // (N, H)
    torch::Tensor gh = torch::empty_like(flat);             // one (N, H) buffer, filled per tile
    // The block's weights (norm + MLP), their gradients summed in fp32 over the tiles
    // (model/grad_sums.h).
    std::vector<torch::Tensor> weights;
    for (const auto& p : state->layer->post_attention_layernorm->parameters()) weights.push_back(p);
    for (const auto& p : state->layer->mlp->parameters()) weights.push_back(p);
    std::erase_if(weights, [](const torch::Tensor& p) { return !p.requires_grad(); });
    model::Fp32GradSums sums(weights);
    for (int64_t t0 = 0; t0 < flat.size(0); t0 += state->tile) {
      const int64_t n = std::min(state->tile, flat.size(0) - t0);
      torch::Tensor x = flat.narrow(0, t0, n).detach().requires_grad_(true);
      torch::Tensor y;
      {
        torch::AutoGradMode grad(true);
        y = state->layer->MlpBlock(x);  // via (n, intermediate) only
      }
      std::vector<torch::Tensor> inputs = {x};
      inputs.insert(inputs.end(), weights.begin(), weights.end());
      std::vector<torch::Tensor> d = torch::autograd::grad({y}, inputs, {g.narrow(0, t0, n)}, /*retain_graph=*/false,
                                                           /*create_graph=*/false, /*allow_unused=*/true);
      gh.narrow(0, t0, n).copy_(d[0]);
      sums.Add(std::vector<torch::Tensor>(d.begin() + 1, d.end()));
    }
    sums.WriteGrads();
    return {gh.view(h.sizes()), torch::Tensor()};
  }
};

// The backward of logits = hidden @ W^T through log-softmax, tile by tile: with
// d/d logits = (softmax - onehot(label)) * coef per row, returns (d hidden, d W) in their
// dtypes. Both tiled head Functions use it (the loss: coef = mask * upstream; per-token
// logprobs: coef = -upstream). hidden (B, S, H), W (V, H), labels (B, S), coef (B*S,) fp32.
// With weight_grad false (a frozen head: LoRA) d W is undefined and no accumulator exists.
std::pair<torch::Tensor, torch::Tensor> HeadBackward(const torch::Tensor& hidden, const torch::Tensor& weight,
                                                     const torch::Tensor& labels, const torch::Tensor& coef,
                                                     int64_t tile, bool weight_grad) {
  torch::Tensor h = hidden.reshape({-1, hidden.size(-1)});  // (N, H)
  torch::Tensor y = labels.reshape({-1});                    // (N,)
  torch::Tensor gh = torch::empty_like(h);                   // (N, H)
  // fp32 accumulator for the head's gradient: summing bf16 tile products in bf16 would lose
  // the small ones. (V, H) is the size of the weight itself, not of the sequence.
  torch::Tensor gw = weight_grad ? torch::zeros(weight.sizes(), weight.options().dtype(torch::kFloat32)) : torch::Tensor();
  for (int64_t t0 = 0; t0 < h.size(0); t0 += tile) {
    const int64_t n = std::min(tile, h.size(0) - t0);
    torch::Tensor ht = h.narrow(0, t0, n);                                                  // (n, H)
    torch::Tensor p = torch::softmax(LogitsFp32(ht, weight), -1);  // (n, V)
    p.scatter_add_(1, y.narrow(0, t0, n).unsqueeze(1), torch::full({n, 1}, -1.0f, p.options()));
    p.mul_(coef.narrow(0, t0, n).unsqueeze(1));
    torch::Tensor pd = p.to(weight.scalar_type());
    gh.narrow(0, t0, n).copy_(torch::matmul(pd, weight));  // (n, H)
    if (weight_grad) gw.add_(torch::matmul(pd.t(), ht));    // (V, H)
  }
  return {gh.view(hidden.sizes()), weight_grad ? gw.to(weight.scalar_type()) : torch::Tensor()};
}

class TiledLossFunction : public torch::autograd::Function<TiledLossFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor hidden, torch::Tensor weight, torch::Tensor labels,
                               torch::Tensor mask, int64_t tile) {
    torch::NoGradGuard no_grad;
    torch::Tensor h = hidden.reshape({-1, hidden.size(-1)});  // (N, H)
    torch::Tensor y = labels.reshape({-1});                    // (N,)
    torch::Tensor m = mask.reshape({-1}).to(torch::kFloat32);  // (N,)
    torch::Tensor total = torch::zeros({}, h.options().dtype(torch::kFloat32));
    for (int64_t t0 = 0; t0 < h.size(0); t0 += tile) {
      const int64_t n = std::min(tile, h.size(0) - t0);
      torch::Tensor logits = LogitsFp32(h.narrow(0, t0, n), weight);  // (n, V)
      torch::Tensor lse = torch::logsumexp(logits, -1);                                           // (n,)
      torch::Tensor tgt = logits.gather(1, y.narrow(0, t0, n).unsqueeze(1)).squeeze(1);          // (n,)
      total.add_(((lse - tgt) * m.narrow(0, t0, n)).sum());
    }
    ctx->save_for_backward({hidden, weight, labels, mask});
    ctx->saved_data["tile"] = tile;
    return total;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const torch::Tensor& hidden = saved[0];
    const torch::Tensor& weight = saved[1];
    const int64_t tile = ctx->saved_data["tile"].toInt();
    ProfilePhase phase("loss backward");
    // d loss / d logits = (softmax - onehot) * mask * upstream.
    torch::Tensor coef = saved[3].reshape({-1}).to(torch::kFloat32) * grads[0].to(torch::kFloat32);  // (N,)
    auto [gh, gw] = HeadBackward(hidden, weight, saved[2], coef, tile, ctx->needs_input_grad(1));
    return {gh, gw, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

class TiledLogprobFunction : public torch::autograd::Function<TiledLogprobFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor hidden, torch::Tensor weight, torch::Tensor labels,
                               int64_t tile) {
    torch::NoGradGuard no_grad;
    torch::Tensor h = hidden.reshape({-1, hidden.size(-1)});  // (N, H)
    torch::Tensor y = labels.reshape({-1});                    // (N,)
    torch::Tensor out = torch::empty({h.size(0)}, h.options().dtype(torch::kFloat32));  // (N,)
    for (int64_t t0 = 0; t0 < h.size(0); t0 += tile) {
      const int64_t n = std::min(tile, h.size(0) - t0);
      torch::Tensor logits = LogitsFp32(h.narrow(0, t0, n), weight);  // (n, V)
      torch::Tensor tgt = logits.gather(1, y.narrow(0, t0, n).unsqueeze(1)).squeeze(1);          // (n,)
      out.narrow(0, t0, n).copy_(tgt - torch::logsumexp(logits, -1));
    }
    ctx->save_for_backward({hidden, weight, labels});
    ctx->saved_data["tile"] = tile;
    return out.view(labels.sizes());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const torch::Tensor& hidden = saved[0];
    const torch::Tensor& weight = saved[1];
    const int64_t tile = ctx->saved_data["tile"].toInt();
    // d logp / d logits = (onehot - softmax) * upstream = (softmax - onehot) * -upstream.
    torch::Tensor coef = -grads[0].reshape({-1}).to(torch::kFloat32);  // (N,)
    auto [gh, gw] = HeadBackward(hidden, weight, saved[2], coef, tile, ctx->needs_input_grad(1));
    return {gh, gw, torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor TiledTokenLogprobs(const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& labels,
                                 int64_t tile_tokens) {
  return TiledLogprobFunction::apply(hidden, weight, labels, tile_tokens);
}

torch::Tensor ShapeOnly(const torch::Tensor& like) {
  return torch::empty_strided(like.sizes(), std::vector<int64_t>(static_cast<size_t>(like.dim()), 0), like.options());
}

torch::Tensor CheckpointBlock(const torch::Tensor& x, BlockBody body, SavedInputs* store, int64_t slot,
                              std::shared_ptr<void> keepalive, std::function<void()> after_backward,
                              const std::string& label, std::function<torch::Tensor()> regenerate,
                              bool prefetch_below) {
  ProfilePhase phase(label + " forward");
  if (!torch::GradMode::is_enabled()) return body(x, /*recompute=*/false);
  auto state = c10::make_intrusive<BlockState>();
  state->label = label;
  state->body = std::move(body);
  state->store = store;
  state->slot = slot;
  state->keepalive = std::move(keepalive);
  state->after_backward = std::move(after_backward);
  state->regenerate = std::move(regenerate);
  state->prefetch_below = prefetch_below;
  // The Function records a backward node only for inputs that need grad; the block's
  // parameters need it even when x does not.
  return CheckpointFunction::apply(x.requires_grad() ? x : x.detach().requires_grad_(true), state);
}

torch::Tensor TiledMlpBlock(model::DecoderLayer layer, const torch::Tensor& h, int64_t tile_tokens,
                            bool output_unused) {
  TORCH_CHECK(layer->mlp, "TiledMlpBlock needs a dense MLP: an MoE layer tiles itself (model/moe.h)");
  if (!torch::GradMode::is_enabled()) {
    torch::Tensor flat = h.reshape({-1, h.size(-1)});  // (N, H)
    torch::Tensor out = torch::empty_like(flat);
    for (int64_t t0 = 0; t0 < flat.size(0); t0 += tile_tokens) {
      const int64_t n = std::min(tile_tokens, flat.size(0) - t0);
      out.narrow(0, t0, n).copy_(layer->MlpBlock(flat.narrow(0, t0, n)));
    }
    return out.view(h.sizes());
  }
  auto state = c10::make_intrusive<MlpState>();
  state->layer = layer;
  state->tile = tile_tokens;
  state->output_unused = output_unused;
  return TiledMlpFunction::apply(h, state);
}

torch::Tensor TiledCrossEntropySum(const torch::Tensor& hidden, const torch::Tensor& weight,
                                   const torch::Tensor& labels, const torch::Tensor& mask, int64_t tile_tokens) {
  return TiledLossFunction::apply(hidden, weight, labels, mask, tile_tokens);
}

}  // namespace odyssey::engine::memory
