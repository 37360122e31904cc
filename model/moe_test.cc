// The MoE MLP (model/moe.h): tiled = untiled = a naive per-token reference written with plain
// autograd (outputs, gradients of the input and of every parameter, the load-balancing loss
// included; fp32), replay reuses the recorded routing, the config's MoE fields parse, refuse
// and round-trip by name in both families, and the MoE named shapes build as their configs say.
#include "model/moe.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "model/causal_lm.h"
#include "model/config.h"

namespace odyssey::model {
namespace {

ModelConfig MoeShape(bool shared) {
  ModelConfig c = NamedShape("qwen3-moe-tiny").value();
  c.hidden_size = 24;
  c.moe.num_experts = 6;
  c.moe.num_experts_per_tok = 2;
  c.moe.moe_intermediate_size = 10;
  if (shared) {
    c.architecture = Architecture::kQwen2;
    c.moe.shared_expert_intermediate_size = 14;
  }
  return c;
}

// Weights away from the init, with a decisive router (std 0.02 logits make near-ties
// everywhere); expert 0's row leans along `lean` so it takes about 4x the mean load.
void Perturb(MoeMlpImpl& moe, const torch::Tensor& lean) {
  torch::NoGradGuard no_grad;
  torch::manual_seed(7);
  for (auto& p : moe.parameters()) p.normal_(0.0, 0.3);
  moe.gate->weight.narrow(0, 0, 1).add_(lean.unsqueeze(0) * 0.6);
}

// Plain autograd, one token at a time: y_t = sum over the top-k of w_e * expert_e(x_t) (+ the
// gated shared expert); also the router probabilities (N, E) for the load-balancing loss.
std::pair<torch::Tensor, torch::Tensor> NaiveMoe(MoeMlpImpl& moe, const torch::Tensor& x, bool norm_topk) {
  namespace F = torch::nn::functional;
  auto mlp = [](Mlp& m, const torch::Tensor& v) {
    return F::linear(F::silu(F::linear(v, m->gate_proj->weight)) * F::linear(v, m->up_proj->weight),
                     m->down_proj->weight);
  };
  std::vector<torch::Tensor> ys, ps;
  for (int64_t t = 0; t < x.size(0); ++t) {
    torch::Tensor xt = x[t];                                                    // (H,)
    torch::Tensor p = torch::softmax(F::linear(xt, moe.gate->weight), -1);     // (E,)
    torch::Tensor top = std::get<1>(torch::topk(p.detach(), moe.top_k()));      // (k,)
    torch::Tensor w = p.index_select(0, top);
    if (norm_topk) w = w / w.sum();
    torch::Tensor y = torch::zeros_like(xt);
    for (int64_t i = 0; i < moe.top_k(); ++i)
      y = y + w[i] * mlp(moe.expert_list[static_cast<size_t>(top[i].item<int64_t>())], xt);
    if (moe.shared_expert) y = y + torch::sigmoid(F::linear(xt, moe.shared_expert_gate->weight)) * mlp(moe.shared_expert, xt);
    ys.push_back(y);
    ps.push_back(p);
  }
  return {torch::stack(ys), torch::stack(ps)};
}

// transformers' load_balancing_loss_func for one layer: E * sum_e f_e * P_e.
torch::Tensor NaiveAux(const torch::Tensor& probs, int64_t k) {
  const int64_t N = probs.size(0), E = probs.size(1);
  torch::Tensor top = std::get<1>(torch::topk(probs.detach(), k, -1));                     // (N, k)
  torch::Tensor f = torch::one_hot(top, E).to(torch::kFloat32).view({-1, E}).sum(0) / static_cast<double>(N);  // (E,)
  return static_cast<double>(E) * (f * probs.mean(0)).sum();
}

struct Grads {
  torch::Tensor y, dx;
  std::map<std::string, torch::Tensor> dp;
};

double Rel(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).norm().item<double>() / std::max(b.norm().item<double>(), 1e-30);
}

class MoeTest : public ::testing::TestWithParam<bool> {};

// Tiles of 5 over 26 tokens (a partial last tile), one whole tile and the naive per-token
// reference agree on the output, the input's gradient and every parameter's, with the
// load-balancing loss (coef 0.5) in the loss; the busiest expert takes >= 2.5x the mean load
// (3x is the most top-2 of 6 experts allows).
TEST_P(MoeTest, TiledEqualsUntiledEqualsNaivePerTokenReference) {
  const bool shared = GetParam();
  const ModelConfig c = MoeShape(shared);
  ASSERT_TRUE(c.Validate().ok()) << c.Validate();
  MoeMlp moe(c);
  torch::manual_seed(3);
  torch::Tensor lean = torch::randn({c.hidden_size});
  torch::Tensor x0 = torch::randn({2, 13, c.hidden_size}) + 0.7 * lean;  // (B, S, H)
  torch::Tensor r = torch::randn({2, 13, c.hidden_size});
  Perturb(*moe, lean);
  const double coef = 0.5;
  auto run = [&](int64_t tile) {
    moe->zero_grad();
    torch::Tensor x = x0.clone().requires_grad_(true);
    Grads g;
    torch::Tensor loss;
    if (tile < 0) {
      auto [y, p] = NaiveMoe(*moe, x.view({-1, c.hidden_size}), c.moe.norm_topk_prob);
      g.y = y.view(x.sizes());
      loss = (g.y * r).sum() + coef * NaiveAux(p, c.moe.num_experts_per_tok);
    } else {
      moe->set_tile_tokens(tile);
      g.y = moe->forward(x);
      loss = (g.y * r).sum() + MoeAuxLoss({moe.ptr()}, coef, g.y);
    }
    loss.backward();
    g.y = g.y.detach();
    g.dx = x.grad().clone();
    for (auto& p : moe->named_parameters())
      g.dp[p.key()] = p.value().grad().defined() ? p.value().grad().clone() : torch::zeros_like(p.value());
    return g;
  };
  const Grads naive = run(-1), whole = run(0), tiled = run(5);
  std::vector<int64_t> load = MoeExpertTokens({moe.ptr()});
  const int64_t busiest = *std::max_element(load.begin(), load.end());
  EXPECT_GE(busiest * c.moe.num_experts, 5 * 26 * c.moe.num_experts_per_tok / 2) << "routing is not uneven";
  for (const Grads* g : {&whole, &tiled}) {
    // fp32; the issue's bar is 1e-5 (the worst is printed below).
    double worst = std::max(Rel(g->y, naive.y), Rel(g->dx, naive.dx));
    for (const auto& [name, ref] : naive.dp) worst = std::max(worst, Rel(g->dp.at(name), ref));
    std::printf("%s: worst relative difference from the naive reference %.2e\n", g == &whole ? "one tile" : "tiles of 5",
                worst);
    EXPECT_LE(Rel(g->y, naive.y), 1e-5);
    EXPECT_LE(Rel(g->dx, naive.dx), 1e-5);
    size_t seen = 0;  // parameters with a gradient: an expert no token chose has none
    for (const auto& [name, ref] : naive.dp) {
      SCOPED_TRACE(name);
      if (ref.norm().item<double>() == 0) {
        EXPECT_EQ(g->dp.at(name).norm().item<double>(), 0);
        continue;
      }
      ++seen;
      EXPECT_LE(Rel(g->dp.at(name), ref), 1e-5);
    }
    EXPECT_GE(seen + 3, naive.dp.size());
  }
  // The aux loss reaches the router: without it the gate's gradient differs.
  moe->zero_grad();
  moe->set_tile_tokens(5);
  torch::Tensor x = x0.clone().requires_grad_(true);
  (moe->forward(x) * r).sum().backward();
  EXPECT_GT(Rel(moe->gate->weight.grad(), naive.dp.at("gate.weight")), 1e-3);
}

INSTANTIATE_TEST_SUITE_P(RoutedAndShared, MoeTest, ::testing::Bool());

// A replay pass reuses the recorded routing even after the router changed: its output equals a
// deciding pass with the old router's decisions, never one that re-decides.
TEST(MoeReplayTest, ReplayNeverReRoutes) {
  const ModelConfig c = MoeShape(false);
  MoeMlp moe(c);
  torch::manual_seed(5);
  torch::Tensor lean = torch::randn({c.hidden_size});
  Perturb(*moe, lean);
  torch::NoGradGuard no_grad;
  torch::Tensor x = torch::randn({40, c.hidden_size});
  moe->forward(x);
  const torch::Tensor decided = moe->routing().clone();
  moe->gate->weight.add_(torch::randn_like(moe->gate->weight) * 0.3);  // flips decisions
  torch::Tensor replayed, rerouted;
  {
    MoePassScope pass(moe.ptr().get(), RoutingMode::kReplay, false);
    replayed = moe->forward(x);
  }
  EXPECT_TRUE(torch::equal(moe->routing(), decided));
  rerouted = moe->forward(x);
  ASSERT_FALSE(torch::equal(moe->routing(), decided)) << "the perturbation flipped no decision";
  EXPECT_GT((replayed - rerouted).abs().max().item<double>(), 1e-3);
  // The replayed output is the new weights at the old decisions, tile by tile.
  torch::Tensor ref = moe->Tile(x, decided.to(torch::kLong), nullptr);
  EXPECT_LE(Rel(replayed, ref), 1e-6);
  // A replay of another token count is a programming error, refused.
  MoePassScope pass(moe.ptr().get(), RoutingMode::kReplay, false);
  EXPECT_THROW(moe->forward(x.narrow(0, 0, 7)), c10::Error);
}

TEST(MoeConfigTest, HfFieldsParseRefuseAndRoundTrip) {
  const std::string text = R"({"model_type": "qwen3_moe", "vocab_size": 300, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
    "norm_topk_prob": true, "decoder_sparse_step": 2, "mlp_only_layers": [3],
    "router_aux_loss_coef": 0.02, "output_router_logits": true})";
  auto c = ParseHfConfig(text, "cfg");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->architecture, Architecture::kQwen3);
  EXPECT_EQ(c->moe.num_experts, 8);
  EXPECT_TRUE(c->moe.norm_topk_prob);
  EXPECT_DOUBLE_EQ(c->moe.router_aux_loss_coef, 0.02);
  // (i + 1) % 2 == 0 and not in mlp_only_layers: layer 1 only.
  EXPECT_FALSE(c->moe.IsMoeLayer(0));
  EXPECT_TRUE(c->moe.IsMoeLayer(1));
  EXPECT_FALSE(c->moe.IsMoeLayer(3));
  auto back = ParseHfConfig(ToHfConfigJson(*c, "float32"), "back");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->moe.mlp_only_layers, c->moe.mlp_only_layers);
  EXPECT_EQ(back->moe.decoder_sparse_step, 2);
  EXPECT_TRUE(back->moe.output_router_logits);
  EXPECT_NE(ToHfConfigJson(*c, "float32").find("Qwen3MoeForCausalLM"), std::string::npos);
  // The parameter count matches the module tree.
  CausalLM m(*c);
  int64_t n = 0;
  for (const auto& p : m->parameters()) n += p.numel();
  EXPECT_EQ(n, c->NumParameters());
  EXPECT_TRUE(m->model->layer_list[1]->moe != nullptr);
  EXPECT_TRUE(m->model->layer_list[3]->mlp);

  auto refused = [&](const std::string& from, const std::string& to, const std::string& needle) {
    std::string t = text;
    t.replace(t.find(from), from.size(), to);
    auto r = ParseHfConfig(t, "cfg");
    ASSERT_FALSE(r.ok()) << to;
    EXPECT_NE(std::string(r.status().message()).find(needle), std::string::npos) << r.status();
  };
  refused(R"("num_experts_per_tok": 2)", R"("num_experts_per_tok": 9)", "num_experts_per_tok (9)");
  refused(R"("moe_intermediate_size": 16)", R"("moe_intermediate_size": 0)", "moe_intermediate_size (0)");
  refused(R"("mlp_only_layers": [3])", R"("mlp_only_layers": [4])", "mlp_only_layers entry (4)");
  refused(R"("decoder_sparse_step": 2)", R"("decoder_sparse_step": 0)", "decoder_sparse_step (0)");
  refused(R"("num_experts": 8,)", R"("num_experts": 8, "shared_expert_intermediate_size": 32,)",
          "shared_expert_intermediate_size");
  refused(R"("qwen3_moe")", R"("qwen2_moe")", "missing field 'shared_expert_intermediate_size'");
}

// The hybrid family with the MoE MLP: hybrid-tiny-moe's config.json carries the MoE fields (the
// shared expert optional there) and reads back equal; every layer is KDA or DSA with the experts
// and a shared expert, the parameter count is the module tree's, and one backward with the
// load-balancing loss reaches every layer's router beside the DSA layer's indexer KL.
TEST(MoeConfigTest, HybridMoeShapesRoundTripBuildAndTrainBothAuxiliaryLosses) {
  absl::StatusOr<ModelConfig> c = NamedShape("hybrid-tiny-moe");
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(c->IsHybrid());
  const std::string text = ToHfConfigJson(*c, "float32");
  absl::StatusOr<ModelConfig> back = ParseHfConfig(text, "h.json");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->IsHybrid());
  EXPECT_EQ(ToHfConfigJson(*back, "float32"), text);
  EXPECT_EQ(back->moe.num_experts, 8);
  EXPECT_EQ(back->moe.shared_expert_intermediate_size, 64);
  EXPECT_TRUE(back->moe.output_router_logits);
  EXPECT_EQ(back->NumParameters(), c->NumParameters());
  // hybrid-tiny without MoE writes no MoE field (its config.json is what it was).
  EXPECT_EQ(ToHfConfigJson(*NamedShape("hybrid-tiny"), "float32").find("num_experts"), std::string::npos);

  auto refused = [&](const std::string& from, const std::string& to, const std::string& needle) {
    std::string bad = text;
    const size_t at = bad.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    bad.replace(at, from.size(), to);
    absl::StatusOr<ModelConfig> r = ParseHfConfig(bad, "h.json");
    ASSERT_FALSE(r.ok()) << to;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status();
  };
  refused("\"num_experts_per_tok\": 2", "\"num_experts_per_tok\": 9", "num_experts_per_tok (9)");
  refused("\"shared_expert_intermediate_size\": 64", "\"shared_expert_intermediate_size\": -1",
          "shared_expert_intermediate_size (-1)");
  refused("\"num_experts\": 8,", "", "missing field 'num_experts'");
  refused("\"num_experts\": 8", "\"n_routed_experts\": 8", "n_routed_experts is not supported");

  CausalLM m(*c);
  int64_t n = 0;
  for (const auto& p : m->parameters()) n += p.numel();
  EXPECT_EQ(n, c->NumParameters());
  for (const DecoderLayer& layer : m->model->layer_list) {
    EXPECT_TRUE(layer->kda || layer->dsa);
    ASSERT_TRUE(layer->moe != nullptr);
    EXPECT_FALSE(layer->mlp);
    EXPECT_TRUE(layer->moe->shared_expert);
  }
  m->InitRandom(3);
  torch::manual_seed(1);
  ForwardInputs in;
  in.input_ids = torch::randint(0, c->vocab_size, {2, 40}, torch::kInt64);
  torch::Tensor hidden = m->Hidden(in);  // (2, 40, hidden)
  torch::Tensor aux = MoeAuxLoss(MoeLayers(*m), c->moe.router_aux_loss_coef, hidden);
  // coef x the balance term, which is top-k (2) at perfect balance (near it at this init).
  EXPECT_GT(aux.item<double>(), 0.5 * c->moe.router_aux_loss_coef * 2);
  (hidden.square().mean() + aux).backward();
  ASSERT_TRUE(m->IndexerLoss().defined());
  EXPECT_GT(m->IndexerLoss().item<double>(), 0.0);
  for (auto& p : m->named_parameters()) {
    const std::string& name = p.key();
    const bool router = name.size() > 16 && name.compare(name.size() - 16, 16, ".mlp.gate.weight") == 0;
    if (!router && name.find(".indexer.wq.") == std::string::npos) continue;
    ASSERT_TRUE(p.value().grad().defined()) << name;
    EXPECT_GT(p.value().grad().norm().item<double>(), 0.0) << name;
  }
  std::vector<int64_t> load = MoeExpertTokens(MoeLayers(*m));
  ASSERT_EQ(load.size(), 8u);
  int64_t slots = 0;
  for (int64_t l : load) slots += l;
  EXPECT_EQ(slots, 2 * 40 * 2 * c->num_hidden_layers);

  // hybrid-3b-moe: hybrid-3b's layers with the MoE MLP in all 28; the parameters hybrid-3b's dense
  // MLPs had are replaced by the router, 16 experts of 2048 and the shared expert of 4096 (with
  // its gate).
  absl::StatusOr<ModelConfig> big = NamedShape("hybrid-3b-moe");
  ASSERT_TRUE(big.ok()) << big.status();
  ASSERT_TRUE(big->Validate().ok()) << big->Validate();
  EXPECT_EQ(big->NumLayersOfKind('K'), 21);
  EXPECT_EQ(big->NumLayersOfKind('D'), 7);
  for (int64_t i = 0; i < big->num_hidden_layers; ++i) EXPECT_TRUE(big->moe.IsMoeLayer(i)) << i;
  const int64_t h = 3072;
  const int64_t moe_layer = 16 * h + 16 * 3 * h * 2048 + 3 * h * 4096 + h;
  EXPECT_EQ(big->NumParameters() - NamedShape("hybrid-3b")->NumParameters(), 28 * (moe_layer - 3 * h * 8192));
}

}  // namespace
}  // namespace odyssey::model
