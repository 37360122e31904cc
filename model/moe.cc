#include "model/moe.h"

#include <algorithm>
#include <string>

#include <torch/torch.h>

#include "model/causal_lm.h"
#include "model/grad_sums.h"

namespace odyssey::model {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What the tiled Function carries from forward to backward: the module and the routing its
// forward used (never re-decided in backward).
struct MoeTileState : torch::CustomClassHolder {
  std::shared_ptr<MoeMlpImpl> moe;
  torch::Tensor idx;  // (N, k) int32
  int64_t tile = 0;
  bool output_unused = false;
};

int64_t TileOf(int64_t tile, int64_t n) { return tile > 0 ? std::min(tile, n) : std::max<int64_t>(n, 1); }

class MoeTilesFunction : public torch::autograd::Function<MoeTilesFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, c10::intrusive_ptr<MoeTileState> state) {
    const int64_t N = x.size(0), tile = TileOf(state->tile, N);
    torch::Tensor out = torch::empty_like(x);  // (N, H)
    if (!state->output_unused) {
      torch::NoGradGuard no_grad;
      for (int64_t t0 = 0; t0 < N; t0 += tile) {
        const int64_t n = std::min(tile, N - t0);
        out.narrow(0, t0, n).copy_(state->moe->Tile(x.narrow(0, t0, n), state->idx.narrow(0, t0, n).to(torch::kLong),
                                                    nullptr));
      }
    }
    ctx->save_for_backward({x});
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto state = c10::static_intrusive_pointer_cast<MoeTileState>(ctx->saved_data["state"].toCapsule());
    const torch::Tensor x = ctx->get_saved_variables()[0];  // (N, H)
    const torch::Tensor g = grads[0];                      // (N, H)
    const int64_t N = x.size(0), tile = TileOf(state->tile, N);
    const torch::Tensor aux = state->moe->aux_grad();  // (E,) fp32 or undefined
    torch::Tensor gx = torch::empty_like(x);           // one (N, H) buffer, filled per tile
    std::vector<torch::Tensor> weights = state->moe->TileParameters();
    // fp32 sums written into .grad once: adding each tile into a bf16 .grad would round the
    // running sum once per tile.
    Fp32GradSums sums(weights);
    for (int64_t t0 = 0; t0 < N; t0 += tile) {
      const int64_t n = std::min(tile, N - t0);
      torch::Tensor xt = x.narrow(0, t0, n).detach().requires_grad_(true);  // (n, H)
      torch::Tensor probs;                                                  // (n, E) fp32
      torch::Tensor y;
      {
        torch::AutoGradMode grad(true);
        y = state->moe->Tile(xt, state->idx.narrow(0, t0, n).to(torch::kLong), &probs);  // (n, H)
      }
      std::vector<torch::Tensor> outputs = {y};
      std::vector<torch::Tensor> upstream = {g.narrow(0, t0, n)};
      if (aux.defined()) {
        torch::AutoGradMode grad(true);
        outputs.push_back(probs.sum(0));  // (E,): the aux loss reads the probabilities only through it
        upstream.push_back(aux);
      }
      std::vector<torch::Tensor> inputs = {xt};
      inputs.insert(inputs.end(), weights.begin(), weights.end());
      std::vector<torch::Tensor> d = torch::autograd::grad(outputs, inputs, upstream, /*retain_graph=*/false,
                                                           /*create_graph=*/false, /*allow_unused=*/true);
      if (d[0].defined()) {
        gx.narrow(0, t0, n).copy_(d[0]);
      } else {
        gx.narrow(0, t0, n).zero_();
      }
      sums.Add(std::vector<torch::Tensor>(d.begin() + 1, d.end()));  // undefined: an expert no token chose
    }
    sums.WriteGrads();
    return {gx, torch::Tensor()};
  }
};

struct AuxState : torch::CustomClassHolder {
  std::vector<std::shared_ptr<MoeMlpImpl>> layers;
  double coef = 0;
  torch::Tensor counts;  // (E,) fp32, summed over the layers
  double scale = 0;      // coef * E / T^2
};

class MoeAuxFunction : public torch::autograd::Function<MoeAuxFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor anchor, c10::intrusive_ptr<AuxState> state) {
    (void)anchor;  // only orders the backward: this node runs before every layer's
    torch::NoGradGuard no_grad;
    torch::Tensor counts, probs;
    int64_t T = 0;
    for (const auto& l : state->layers) {
      TORCH_CHECK(l->expert_counts().defined(), "MoeAuxLoss: a layer has not run a forward");
      counts = counts.defined() ? counts + l->expert_counts().to(torch::kFloat32) : l->expert_counts().to(torch::kFloat32);
      probs = probs.defined() ? probs + l->prob_sum() : l->prob_sum().clone();
      T += l->routed_tokens();
    }
    const double E = static_cast<double>(state->layers[0]->num_experts());
    const double t = static_cast<double>(std::max<int64_t>(T, 1));
    state->counts = counts;
    state->scale = state->coef * E / (t * t);
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return (counts * probs).sum() * state->scale;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto state = c10::static_intrusive_pointer_cast<AuxState>(ctx->saved_data["state"].toCapsule());
    // d/d prob_sum_e of (E / T^2) sum_e C_e * prob_sum_e, the same for every layer (the counts
    // are not differentiable).
    torch::Tensor w = state->counts * (grads[0].to(torch::kFloat32) * state->scale);  // (E,)
    for (const auto& l : state->layers) l->set_aux_grad(w);
    ctx->saved_data.clear();
    return {torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

MoeMlpImpl::MoeMlpImpl(const ModelConfig& c)
    : num_experts_(c.moe.num_experts), top_k_(c.moe.num_experts_per_tok), norm_topk_prob_(c.moe.norm_topk_prob) {
  TORCH_CHECK(c.moe.enabled(), "MoeMlp needs moe.num_experts > 0");
  gate = register_module("gate", torch::nn::Linear(torch::nn::LinearOptions(c.hidden_size, num_experts_).bias(false)));
  ModelConfig expert_config = c;  // the experts are the dense MLP at the experts' width
  expert_config.mlp_bias = false;
  expert_config.intermediate_size = c.moe.moe_intermediate_size;
  experts = register_module("experts", torch::nn::ModuleList());
  for (int64_t e = 0; e < num_experts_; ++e) {
    Mlp expert(expert_config);
    experts->push_back(expert);
    expert_list.push_back(expert);
  }
  if (c.moe.shared_expert_intermediate_size > 0) {
    ModelConfig shared_config = expert_config;
    shared_config.intermediate_size = c.moe.shared_expert_intermediate_size;
    shared_expert = register_module("shared_expert", Mlp(shared_config));
    shared_expert_gate = register_module(
        "shared_expert_gate", torch::nn::Linear(torch::nn::LinearOptions(c.hidden_size, 1).bias(false)));
  }
}

std::vector<torch::Tensor> MoeMlpImpl::TileParameters() {
  std::vector<torch::Tensor> out;
  for (const auto& p : parameters())
    if (p.requires_grad()) out.push_back(p);
  return out;
}

torch::Tensor MoeMlpImpl::Tile(const torch::Tensor& x, const torch::Tensor& idx, torch::Tensor* probs) {
  const int64_t k = top_k_;
  torch::Tensor p = torch::softmax(gate(x), -1, torch::kFloat32);  // (n, E) fp32, as transformers
  torch::Tensor w = p.gather(1, idx);                                // (n, k)
  if (norm_topk_prob_) w = w / w.sum(-1, /*keepdim=*/true);
  w = w.to(x.scalar_type());
  // Dispatch: the tile's (token, slot) pairs sorted by expert, so each expert reads one
  // contiguous run of at most n rows.
  torch::Tensor flat = idx.reshape({-1});                                          // (n k,)
  torch::Tensor order = std::get<1>(flat.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false));  // (n k,)
  torch::Tensor token = order.div(k, "floor");                                     // (n k,) row of each pair
  torch::Tensor slot_w = w.reshape({-1}).index_select(0, order);                   // (n k,)
  torch::Tensor per_expert = torch::bincount(flat, {}, num_experts_).cpu();        // (E,) int64
  const int64_t* cnt = per_expert.data_ptr<int64_t>();
  torch::Tensor y = torch::zeros_like(x);  // (n, H)
  int64_t off = 0;
  for (int64_t e = 0; e < num_experts_; ++e) {  // ascending, as transformers adds them
    const int64_t c = cnt[e];
    if (c == 0) continue;
    torch::Tensor rows = token.narrow(0, off, c);                                       // (c,)
    torch::Tensor out = expert_list[static_cast<size_t>(e)]->forward(x.index_select(0, rows));  // (c, H) via (c, I)
    y.index_add_(0, rows, out * slot_w.narrow(0, off, c).unsqueeze(1));
    off += c;
  }
  if (shared_expert) y = y + torch::sigmoid(shared_expert_gate(x)) * shared_expert->forward(x);  // (n, H)
  if (probs != nullptr) *probs = p;
  return y;
}

void MoeMlpImpl::Route(const torch::Tensor& flat) {
  torch::NoGradGuard no_grad;
  const int64_t N = flat.size(0), tile = TileOf(tile_tokens_, N);
  routing_ = torch::empty({N, top_k_}, flat.options().dtype(torch::kInt32));  // (N, k)
  counts_ = torch::zeros({num_experts_}, flat.options().dtype(torch::kLong));
  prob_sum_ = torch::zeros({num_experts_}, flat.options().dtype(torch::kFloat32));
  for (int64_t t0 = 0; t0 < N; t0 += tile) {
    const int64_t n = std::min(tile, N - t0);
    torch::Tensor p = torch::softmax(gate(flat.narrow(0, t0, n)), -1, torch::kFloat32);  // (n, E)
    torch::Tensor idx = std::get<1>(torch::topk(p, top_k_, -1));                         // (n, k)
    routing_.narrow(0, t0, n).copy_(idx);
    counts_.add_(torch::bincount(idx.reshape({-1}), {}, num_experts_));
    prob_sum_.add_(p.sum(0));
  }
  routed_tokens_ = N;
  aux_grad_ = torch::Tensor();
}

torch::Tensor MoeMlpImpl::forward(const torch::Tensor& x) {
  const int64_t H = x.size(-1);
  torch::Tensor flat = x.reshape({-1, H});  // (N, H)
  if (mode_ == RoutingMode::kReplay) {
    TORCH_CHECK(routing_.defined() && routing_.size(0) == flat.size(0),
                "MoE replay without a recorded forward of the same ", flat.size(0), " tokens");
  } else {
    Route(flat);
  }
  auto state = c10::make_intrusive<MoeTileState>();
  state->moe = std::dynamic_pointer_cast<MoeMlpImpl>(shared_from_this());
  state->idx = routing_;
  state->tile = tile_tokens_;
  state->output_unused = output_unused_;
  if (torch::GradMode::is_enabled()) {
    // The Function records a backward node only for inputs that need grad; the parameters
    // need it even when x does not.
    torch::Tensor in = flat.requires_grad() ? flat : flat.detach().requires_grad_(true);
    return MoeTilesFunction::apply(in, state).view(x.sizes());
  }
  torch::Tensor out = torch::empty_like(flat);  // (N, H)
  const int64_t N = flat.size(0), tile = TileOf(tile_tokens_, N);
  for (int64_t t0 = 0; t0 < N; t0 += tile) {
    const int64_t n = std::min(tile, N - t0);
    out.narrow(0, t0, n).copy_(Tile(flat.narrow(0, t0, n), routing_.narrow(0, t0, n).to(torch::kLong), nullptr));
  }
  return out.view(x.sizes());
}

MoePassScope::MoePassScope(MoeMlpImpl* moe, RoutingMode mode, bool output_unused) : moe_(moe) {
  if (moe_ == nullptr) return;
  moe_->set_routing_mode(mode);
  moe_->set_output_unused(output_unused);
}

MoePassScope::~MoePassScope() {
  if (moe_ == nullptr) return;
  moe_->set_routing_mode(RoutingMode::kDecide);
  moe_->set_output_unused(false);
}

std::vector<std::shared_ptr<MoeMlpImpl>> MoeLayers(CausalLMImpl& model) {
  std::vector<std::shared_ptr<MoeMlpImpl>> out;
  for (const DecoderLayer& layer : model.model->layer_list)
    if (layer->moe) out.push_back(layer->moe);
  return out;
}

torch::Tensor MoeAuxLoss(const std::vector<std::shared_ptr<MoeMlpImpl>>& layers, double coef,
                         const torch::Tensor& anchor) {
  TORCH_CHECK(!layers.empty(), "MoeAuxLoss needs at least one MoE layer");
  auto state = c10::make_intrusive<AuxState>();
  state->layers = layers;
  state->coef = coef;
  return MoeAuxFunction::apply(anchor, state);
}

std::vector<int64_t> MoeExpertTokens(const std::vector<std::shared_ptr<MoeMlpImpl>>& layers) {
  if (layers.empty()) return {};
  torch::Tensor sum = torch::zeros({layers[0]->num_experts()}, torch::kLong);
  for (const auto& l : layers)
    if (l->expert_counts().defined()) sum += l->expert_counts().cpu();
  return std::vector<int64_t>(sum.data_ptr<int64_t>(), sum.data_ptr<int64_t>() + sum.numel());
}

}  // namespace odyssey::model
