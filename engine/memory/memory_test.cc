// Every memory strategy must leave the gradients of plain autograd unchanged (fp32, CPU), and
// must do what it is for: offload leaves no saved input on the device and prefetches the next
// one, and the strategies that skip a forward run it fewer times (counted, not assumed).
#include "engine/memory/strategy.h"

#include <ATen/record_function.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <map>

#include "absl/strings/match.h"
#include "engine/loss.h"
#include "engine/memory/attention_stash.h"
#include "engine/memory/checkpoint.h"
#include "engine/memory/host_pool.h"
#include "model/hybrid.h"
#include "model/moe.h"

namespace odyssey::engine::memory {
namespace {

model::ModelConfig Config() {
  model::ModelConfig c;
  c.architecture = model::Architecture::kQwen3;  // q/k norms exercise the most paths
  c.vocab_size = 97;
  c.hidden_size = 64;
  c.intermediate_size = 112;
  c.num_hidden_layers = 5;  // odd: every_k=2 leaves a group of one
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 512;
  c.tie_word_embeddings = true;
  return c;
}

struct Result {
  double loss = 0;
  std::map<std::string, torch::Tensor> grads;
  int64_t attention_forwards = 0;  // calls of the attention kernel's forward (Causal, CausalWithStats)
  int64_t mlp_forwards = 0;        // MLP forwards (of whole rows or of tiles): calls of aten::silu
  int64_t stash_bytes_after = 0;   // bytes the attention stash still holds after the last backward
  int64_t host_pool_bytes = 0;     // the offload pool's after the last step
};

// Calls on_forward before each forward of an attention kernel (Causal, CausalWithStats);
// everything else passes through. Counts forwards, or notes what the stash holds at each.
class ObservedAttention final : public kernels::AttentionBackend {
 public:
  ObservedAttention(std::shared_ptr<const kernels::AttentionBackend> inner, std::function<void()> on_forward)
      : inner_(std::move(inner)), on_forward_(std::move(on_forward)) {}
  std::string name() const override { return inner_->name(); }
  torch::Tensor Causal(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       double scale) const override {
    on_forward_();
    return inner_->Causal(q, k, v, scale);
  }
  bool SupportsStats(const torch::Device& device) const override { return inner_->SupportsStats(device); }
  std::pair<torch::Tensor, kernels::AttentionStats> CausalWithStats(const torch::Tensor& q, const torch::Tensor& k,
                                                                    const torch::Tensor& v,
                                                                    double scale) const override {
    on_forward_();
    return inner_->CausalWithStats(q, k, v, scale);
  }
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> CausalBackward(
      const torch::Tensor& grad_out, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
      const torch::Tensor& out, const kernels::AttentionStats& stats, double scale) const override {
    return inner_->CausalBackward(grad_out, q, k, v, out, stats, scale);
  }

 private:
  std::shared_ptr<const kernels::AttentionBackend> inner_;
  std::function<void()> on_forward_;
};

// Counts calls of aten::silu while alive (a RecordFunction callback): the MLP's activation,
// called once per MLP forward of a row block or a tile, and by nothing else in the model (its
// backward is aten::silu_backward).
class SiluCounter {
 public:
  SiluCounter() {
    calls_ = 0;
    handle_ = at::addGlobalCallback(at::RecordFunctionCallback(
                                        [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
                                          if (std::strcmp(fn.name(), "aten::silu") == 0) ++calls_;
                                          return nullptr;
                                        })
                                        .scopes({at::RecordScope::FUNCTION}));
  }
  ~SiluCounter() { at::removeCallback(handle_); }
  int64_t calls() const { return calls_; }

 private:
  static inline std::atomic<int64_t> calls_{0};
  at::CallbackHandle handle_;
};

struct RunSetup {
  model::ModelConfig config = Config();
  int64_t B = 2, S = 50;
  torch::Device device = torch::kCPU;
  torch::Dtype dtype = torch::kFloat32;
  std::string attention = "math";
  std::vector<std::vector<int64_t>> doc_lens;  // packed documents per row; empty = none
  model::LoraConfig lora;  // rank > 0: adapters on a frozen base (B drawn nonzero, so A gets gradients too)
  // Called after each step's forward and loss, before its backward (which recomputes).
  std::function<void(model::CausalLMImpl&)> before_backward;
  // Called once with the memory stack, before the first step (hooks, observers).
  std::function<void(MemoryStack&)> with_stack;
};

Result RunStrategy(const planner::MemoryStrategy& options, int64_t head_groups = 1, int steps = 1, const RunSetup& setup = {}) {
  const model::ModelConfig& c = setup.config;
  model::CausalLM m(c);
  m->InitRandom(11, 0.1);
  m->to(setup.device, setup.dtype);
  if (setup.lora.enabled()) {
    EXPECT_TRUE(model::AttachLora(*m, setup.lora, 3).ok());
    torch::NoGradGuard no_grad;
    torch::manual_seed(4);
    for (auto& p : m->named_parameters())
      if (p.key().find(".lora_B.") != std::string::npos) p.value().copy_(0.1 * torch::randn(p.value().sizes()));  // CPU draws: the same in every dtype
  }
  auto stack = MemoryStack::Create(options, c.num_hidden_layers);
  EXPECT_TRUE(stack.ok()) << stack.status();
  if (setup.with_stack) setup.with_stack(**stack);
  Result r;
  std::shared_ptr<const kernels::AttentionBackend> kernel =
      std::make_shared<const ObservedAttention>(kernels::MakeAttentionBackend(setup.attention).value(),
                                                [&r] { ++r.attention_forwards; });
  if (options.keep_attention) kernel = std::make_shared<const StashingAttention>(kernel, (*stack)->attention_stash());
  m->set_attention_backend(kernels::WrapHeadGroups(kernel, head_groups));
  torch::manual_seed(5);
  const int64_t B = setup.B, S = setup.S;
  torch::Tensor ids = torch::randint(0, c.vocab_size, {B, S}, torch::kInt64).to(setup.device);
  torch::Tensor labels = torch::randint(0, c.vocab_size, {B, S}, torch::kInt64).to(setup.device);
  torch::Tensor mask = (torch::rand({B, S}) > 0.3).to(torch::kFloat32).to(setup.device);
  EXPECT_TRUE((*stack)->Prepare(B, S, c.hidden_size, setup.dtype).ok());
  SiluCounter silu;
  for (int s = 0; s < steps; ++s) {
    m->zero_grad();
    model::ForwardInputs in;
    in.input_ids = ids;
    torch::Tensor pos;
    if (!setup.doc_lens.empty()) {
      std::vector<torch::Tensor> rows;
      for (const auto& lens : setup.doc_lens) {
        std::vector<torch::Tensor> parts;
        for (int64_t n : lens) parts.push_back(torch::arange(n, torch::kInt64));
        rows.push_back(torch::cat(parts));
      }
      pos = torch::stack(rows).to(setup.device);
      in.position_ids = pos;
      in.doc_lens = &setup.doc_lens;
    }
    torch::Tensor hidden = m->Hidden(in, (*stack)->Runner());
    torch::Tensor loss = (*stack)->LossSum(hidden, m->HeadWeight(), labels, mask);
    // MoE layers: the load-balancing loss too, whose gradient reaches each layer's router
    // through that layer's (re)computed backward (model/moe.h).
    if (c.moe.enabled()) loss = loss + model::MoeAuxLoss(model::MoeLayers(*m), 0.3, hidden);
    if (setup.before_backward) setup.before_backward(*m);
    loss.backward();
    r.loss = loss.item<double>();
  }
  r.mlp_forwards = silu.calls();
  r.stash_bytes_after = (*stack)->attention_stash()->bytes();
  r.host_pool_bytes = (*stack)->host_pool_bytes();
  // Frozen parameters (a LoRA base) have none; a strategy that loses a gradient shows as a
  // missing name in ExpectSameGradients.
  for (auto& p : m->named_parameters())
    if (p.value().grad().defined()) r.grads[p.key()] = p.value().grad().to(torch::kCPU, torch::kFloat32);
  return r;
}

// Every gradient within 1e-5 relative (norm of the difference over the norm), the KDA decay
// parameters (A_log, dt_bias) within `kda_decay_rtol`: each sums S x H x K terms of both signs,
// so a rounding change upstream (another summation order) moves them most.
void ExpectSameGradients(const Result& got, const Result& want, double kda_decay_rtol = 1e-5) {
  EXPECT_NEAR(got.loss, want.loss, 1e-5 * std::abs(want.loss));
  ASSERT_EQ(got.grads.size(), want.grads.size());
  for (const auto& [name, g] : want.grads) {
    const double rel = (got.grads.at(name) - g).norm().item<double>() / g.norm().item<double>();
    const bool decay = absl::EndsWith(name, ".A_log") || absl::EndsWith(name, ".dt_bias");
    EXPECT_LE(rel, decay ? kda_decay_rtol : 1e-5) << name;
  }
}

class MemoryStrategyTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { plain_ = new Result(RunStrategy(planner::MemoryStrategy{})); }
  static Result* plain_;
};
Result* MemoryStrategyTest::plain_ = nullptr;

TEST_F(MemoryStrategyTest, PlainGradientsAreNonTrivial) {
  for (const auto& [name, g] : plain_->grads) EXPECT_GT(g.norm().item<double>(), 0.0) << name;
}

constexpr int64_t kLayers = 5;  // Config().num_hidden_layers

TEST_F(MemoryStrategyTest, LayerRecompute) {
  planner::MemoryStrategy o;
  o.recompute = planner::Recompute::kLayer;
  const Result got = RunStrategy(o);
  ExpectSameGradients(got, *plain_);
  // The counters see what runs: plain autograd runs each layer's attention and MLP once; layer
  // recompute runs both again in backward.
  EXPECT_EQ(plain_->attention_forwards, kLayers);
  EXPECT_EQ(plain_->mlp_forwards, kLayers);
  EXPECT_EQ(got.attention_forwards, 2 * kLayers);
  EXPECT_EQ(got.mlp_forwards, 2 * kLayers);
}

TEST_F(MemoryStrategyTest, NestedEveryTwoLayers) {
  planner::MemoryStrategy o;
  o.recompute = planner::Recompute::kEveryK;
  o.every_k = 2;
  const Result got = RunStrategy(o);
  ExpectSameGradients(got, *plain_);
  // Groups (0, 1), (2, 3), (4): the forward runs 5 layers; a group of two recomputes its first
  // layer to get the second's input, then each layer again for its backward; the group's last
  // layer is not run for the group's output, which is only its graph's root. The group of one
  // recomputes its layer once: 5 + 2 x (1 + 2) + 1.
  EXPECT_EQ(got.attention_forwards, 5 + 2 * 3 + 1);
  EXPECT_EQ(got.mlp_forwards, 5 + 2 * 3 + 1);
}

// The nested group's stand-in output: its shape and dtype, one element of storage (a (T, hidden)
// at 1M tokens is 6 GiB, held through the group's backward as its graph's root).
// NestedEveryTwoLayers shows gradients flow through it as through plain autograd.
TEST(ShapeOnlyTest, HasTheShapeAndOneElementOfStorage) {
  const torch::Tensor like = torch::randn({2, 64, 48}, torch::kBFloat16);
  const torch::Tensor t = ShapeOnly(like);
  EXPECT_EQ(t.sizes(), like.sizes());
  EXPECT_EQ(t.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(t.device(), like.device());
  EXPECT_EQ(t.storage().nbytes(), t.element_size());
}

// A checkpointed block's recomputed output, the root of its graph while its backward runs, gives
// its memory back before that backward (only its grad_fn and shape are read), unless something
// else holds its storage: an op that saved its output. Either way the gradients are plain
// autograd's.
TEST(CheckpointBlockTest, RecomputedOutputReleasedUnlessSaved) {
  torch::manual_seed(7);
  const torch::Tensor x0 = torch::randn({3, 40, 16}, torch::kFloat64);
  const torch::Tensor w = torch::randn({16, 16}, torch::kFloat64).requires_grad_(true);
  for (bool saved_output : {false, true}) {
    // out = tanh(x W) + x: tanh saves its output, but the add makes a fresh one; with
    // saved_output the block ends at exp, which saves the very tensor it returns.
    auto f = [&](const torch::Tensor& x) {
      const torch::Tensor a = torch::tanh(torch::matmul(x, w));
      return saved_output ? torch::exp(a) : a + x;
    };
    std::vector<torch::Tensor> outputs;  // the body's results (handles, not copies)
    SavedInputs store(nullptr, 0);
    store.BeginStep(1);
    const torch::Tensor x = x0.clone().requires_grad_(true);
    const torch::Tensor y = CheckpointBlock(x, [&](const torch::Tensor& xi, bool) {
      outputs.push_back(f(xi));
      return outputs.back();
    }, &store, 0);
    const torch::Tensor g = torch::randn_like(y);
    y.backward(g);
    const torch::Tensor dx = x.grad().clone(), dw = w.grad().clone();
    w.mutable_grad() = torch::Tensor();
    const torch::Tensor xr = x0.clone().requires_grad_(true);
    f(xr).backward(g);
    EXPECT_TRUE(torch::allclose(dx, xr.grad(), 1e-12, 1e-12)) << "saved_output " << saved_output;
    EXPECT_TRUE(torch::allclose(dw, w.grad(), 1e-12, 1e-12)) << "saved_output " << saved_output;
    w.mutable_grad() = torch::Tensor();
    ASSERT_EQ(outputs.size(), 2u);  // the forward's and the recompute's
    EXPECT_EQ(outputs[1].storage().nbytes(), saved_output ? outputs[1].nbytes() : 0u)
        << "the recomputed output, saved_output " << saved_output;
    EXPECT_EQ(outputs[0].storage().nbytes(), outputs[0].nbytes()) << "the forward's output is the block's result";
  }
}

// Nested blocks (a group of two layers, as every_k builds them): the gradient coming into the
// group is freed once the group's top layer is done with it, before the layer below runs its
// backward; it does not live through the whole group's backward. The gradients are plain
// autograd's.
TEST(CheckpointBlockTest, GroupsIncomingGradientFreedAfterItsTopLayer) {
  torch::manual_seed(8);
  const torch::Tensor x0 = torch::randn({2, 24, 8}, torch::kFloat64);
  const torch::Tensor w0 = torch::randn({8, 8}, torch::kFloat64).requires_grad_(true);
  const torch::Tensor w1 = torch::randn({8, 8}, torch::kFloat64).requires_grad_(true);
  const torch::Tensor c = torch::randn({2, 24, 8}, torch::kFloat64);
  auto layer = [](const torch::Tensor& x, const torch::Tensor& w) { return torch::tanh(torch::matmul(x, w)) + x; };
  std::optional<c10::weak_intrusive_ptr<c10::TensorImpl>> incoming;
  int lower_backward_runs = 0;
  bool alive_in_lower_backward = true;
  SavedInputs outer(nullptr, 0);
  outer.BeginStep(1);
  const torch::Tensor x = x0.clone().requires_grad_(true);
  const torch::Tensor y = CheckpointBlock(x, [&](const torch::Tensor& xg, bool recompute) {
    if (!recompute) return layer(layer(xg, w0), w1);
    auto inner = std::make_shared<SavedInputs>(nullptr, 0);
    inner->BeginStep(2);
    torch::Tensor h = CheckpointBlock(xg, [&](const torch::Tensor& xi, bool inner_recompute) {
      if (inner_recompute) {  // the lower layer's backward is about to run
        ++lower_backward_runs;
        alive_in_lower_backward = !incoming || !incoming->expired();
      }
      return layer(xi, w0);
    }, inner.get(), 0, inner, nullptr, "layer 0");
    return CheckpointBlock(h, [&](const torch::Tensor& xi, bool) { return layer(xi, w1); }, inner.get(), 1, inner,
                           nullptr, "layer 1");
  }, &outer, 0, nullptr, nullptr, "layers 0-1");
  // The loss is <y, c>: the gradient into the group is made by the mul's backward, and the hook
  // takes a weak reference to it as it arrives.
  torch::Tensor yy = y;
  yy.register_hook([&](const torch::Tensor& g) {
    incoming.emplace(g.getIntrusivePtr());
  });
  (yy * c).sum().backward();
  EXPECT_EQ(lower_backward_runs, 1);
  EXPECT_FALSE(alive_in_lower_backward) << "the group's incoming gradient outlived its top layer's backward";
  const torch::Tensor dx = x.grad().clone(), dw0 = w0.grad().clone(), dw1 = w1.grad().clone();
  w0.mutable_grad() = torch::Tensor();
  w1.mutable_grad() = torch::Tensor();
  const torch::Tensor xr = x0.clone().requires_grad_(true);
  (layer(layer(xr, w0), w1) * c).sum().backward();
  EXPECT_TRUE(torch::allclose(dx, xr.grad(), 1e-12, 1e-12));
  EXPECT_TRUE(torch::allclose(dw0, w0.grad(), 1e-12, 1e-12));
  EXPECT_TRUE(torch::allclose(dw1, w1.grad(), 1e-12, 1e-12));
}

TEST_F(MemoryStrategyTest, OffloadToHostPool) {
  planner::MemoryStrategy o;
  o.recompute = planner::Recompute::kLayer;
  o.offload = true;
  o.device_resident = 1;
  const Result got = RunStrategy(o);
  ExpectSameGradients(got, *plain_);
  // Five layer inputs: the last on the device, the first (the embedding of the ids) recomputed
  // in its backward, the three between in the pool (B x S x hidden fp32 each).
  const RunSetup setup;
  EXPECT_EQ(got.host_pool_bytes, 3 * setup.B * setup.S * setup.config.hidden_size * 4);
}

// Nested groups with offload: the input of the group below comes back from the host while the
// group's bottom layer runs its backward, not from the group's start (its upper layers run
// without it beside them); a group of one layer starts it at once. Gradients are plain
// autograd's.
TEST(MemoryStrategyNestedOffloadTest, TheGroupBelowsInputComesBackAtTheGroupsBottomLayer) {
  RunSetup setup;
  setup.config.num_hidden_layers = 7;  // groups (0, 1), (2, 3), (4, 5), (6)
  planner::MemoryStrategy o;
  o.recompute = planner::Recompute::kEveryK;
  o.every_k = 2;
  o.offload = true;
  std::map<int64_t, int64_t> at_recompute;    // group's first layer -> saved bytes on the device
  std::map<int64_t, int64_t> after_backward;  // the same when the group's backward is done
  const int64_t input = setup.B * setup.S * setup.config.hidden_size * 4;
  setup.with_stack = [&](MemoryStack& stack) {
    LayerHooks hooks;
    hooks.before_recompute = [&at_recompute, &stack](int64_t first, int64_t) {
      at_recompute[first] = stack.saved_device_bytes();
    };
    hooks.after_backward = [&after_backward, &stack](int64_t first, int64_t) {
      after_backward[first] = stack.saved_device_bytes();
    };
    stack.set_layer_hooks(hooks);
  };
  const Result got = RunStrategy(o, 1, 1, setup);
  RunSetup plain_setup;
  plain_setup.config.num_hidden_layers = 7;
  ExpectSameGradients(got, RunStrategy(planner::MemoryStrategy{}, 1, 1, plain_setup));
  // At each group's start its own input is taken (off the books); nothing of the group below
  // has come back yet, except below the group of one, which starts its copy at once.
  EXPECT_EQ(at_recompute.at(6), input) << "the group of one took slot 3 and started slot 2's copy";
  EXPECT_EQ(at_recompute.at(4), 0) << "slot 1 comes back only at layer 4's backward";
  EXPECT_EQ(after_backward.at(4), input) << "slot 1 came back during the group's backward";
  EXPECT_EQ(at_recompute.at(2), 0) << "slot 0 is recomputed, never fetched";
  EXPECT_EQ(at_recompute.at(0), 0);
}

// The stack's first checkpoint is not kept: its block recomputes its input (the embedding)
// in backward, once, and nothing reads the store's slot. Gradients are plain autograd's; a
// regenerated input of another shape is refused, naming the block.
TEST(CheckpointBlockTest, RegeneratedInputIsRecomputedNotKept) {
  torch::manual_seed(9);
  const torch::Tensor w = torch::randn({16, 16}, torch::kFloat64).requires_grad_(true);
  const torch::Tensor e = torch::randn({30, 16}, torch::kFloat64).requires_grad_(true);  // an embedding
  const torch::Tensor ids = torch::randint(0, 30, {2, 24}, torch::kInt64);
  auto f = [&](const torch::Tensor& x) { return torch::tanh(torch::matmul(x, w)) + x; };
  int regenerated = 0;
  SavedInputs store(nullptr, 0);
  store.BeginStep(2);
  const torch::Tensor x = e.index_select(0, ids.reshape(-1)).view({2, 24, 16});
  const torch::Tensor y0 = CheckpointBlock(x, [&](const torch::Tensor& xi, bool) { return f(xi); }, &store, 0, nullptr,
                                           nullptr, "layer 0", [&] {
                                             ++regenerated;
                                             torch::NoGradGuard no_grad;
                                             return e.index_select(0, ids.reshape(-1)).view({2, 24, 16});
                                           });
  const torch::Tensor y = CheckpointBlock(y0, [&](const torch::Tensor& xi, bool) { return f(xi); }, &store, 1);
  EXPECT_EQ(store.device_bytes(), y0.nbytes()) << "only the second block's input is kept";
  const torch::Tensor g = torch::randn_like(y);
  y.backward(g);
  EXPECT_EQ(regenerated, 1);
  const torch::Tensor dw = w.grad().clone(), de = e.grad().clone();
  w.mutable_grad() = torch::Tensor();
  e.mutable_grad() = torch::Tensor();
  f(f(e.index_select(0, ids.reshape(-1)).view({2, 24, 16}))).backward(g);
  EXPECT_TRUE(torch::allclose(dw, w.grad(), 1e-12, 1e-12));
  EXPECT_TRUE(torch::allclose(de, e.grad(), 1e-12, 1e-12));
  EXPECT_THROW(store.Take(0), c10::Error);

  store.BeginStep(1);
  const torch::Tensor bad = CheckpointBlock(x.detach(), [&](const torch::Tensor& xi, bool) { return f(xi); }, &store, 0,
                                            nullptr, nullptr, "layer 0", [&] { return torch::zeros({2, 23, 16}, x.options()); });
  try {
    bad.sum().backward();
    ADD_FAILURE() << "a regenerated input of another shape was taken";
  } catch (const c10::Error& err) {
    EXPECT_NE(std::string(err.what()).find("checkpointed block 'layer 0': its regenerated input has shape [2, 23, 16]"),
              std::string::npos)
        << err.what();
  }
}

TEST_F(MemoryStrategyTest, TiledMlp) {
  planner::MemoryStrategy o;
  o.mlp_tile = 7;  // does not divide B*S = 100
  ExpectSameGradients(RunStrategy(o), *plain_);
}

// The tiled MLP's backward recomputes every tile, so in a layer's recompute (whose output is
// never read) its forward tiles are skipped: two MLP passes per layer per step, as without
// recompute, instead of three.
TEST_F(MemoryStrategyTest, LayerRecomputeWithTiledMlpSkipsTheUnusedForward) {
  planner::MemoryStrategy o;
  o.recompute = planner::Recompute::kLayer;
  o.mlp_tile = 9;
  const int64_t tiles = (2 * 50 + 8) / 9;  // B*S = 100 positions: 12 tiles, the last of 1
  const Result got = RunStrategy(o);
  ExpectSameGradients(got, *plain_);
  EXPECT_EQ(got.mlp_forwards, 2 * kLayers * tiles) << "first forward + the backward's recompute of each tile";
  planner::MemoryStrategy unrecomputed;
  unrecomputed.mlp_tile = 9;
  EXPECT_EQ(RunStrategy(unrecomputed).mlp_forwards, 2 * kLayers * tiles);
}

// With kept attention outputs the layer's recompute replays the recorded output: one attention
// forward per layer per step (layer recompute alone runs two), and the records are released by
// the end of backward.
TEST_F(MemoryStrategyTest, KeptAttentionOutputsSkipTheAttentionReforward) {
  planner::MemoryStrategy o;
  o.recompute = planner::Recompute::kLayer;
  o.keep_attention = true;
  const Result got = RunStrategy(o);
  ExpectSameGradients(got, *plain_);
  EXPECT_EQ(got.attention_forwards, kLayers);
  EXPECT_EQ(got.stash_bytes_after, 0);
  o.mlp_tile = 9;
  o.loss_tile = 13;
  const Result grouped = RunStrategy(o, /*head_groups=*/2, /*steps=*/2);
  ExpectSameGradients(grouped, *plain_);
  EXPECT_EQ(grouped.attention_forwards, 2 * 2 * kLayers) << "2 steps x 2 head groups x one forward per layer";
  EXPECT_EQ(grouped.stash_bytes_after, 0);
}

// SavedInputs with a host pool: offloaded inputs hold no device memory between forward and
// backward (only the last `device_resident` stay), each Take() returns the saved values and
// prefetches the next slot backward needs, so exactly one fetched input waits on the device.
// On CPU the "device" copies are plain tensors, so device_bytes() counts what a GPU would hold.
TEST(SavedInputsTest, OffloadLeavesOnlyResidentInputsOnTheDeviceAndPrefetchesOneAhead) {
  HostPool pool(/*budget_bytes=*/int64_t{1} << 20, /*pinned=*/true);
  SavedInputs saved(&pool, /*device_resident=*/1);
  ASSERT_TRUE(saved.offloading());
  constexpr int64_t kSlots = 4;
  const int64_t bytes = 2 * 5 * 8 * 4;  // (B, S, H) = (2, 5, 8) fp32
  saved.BeginStep(kSlots);
  std::vector<torch::Tensor> xs;
  for (int64_t i = 0; i < kSlots; ++i) {
    xs.push_back(torch::randn({2, 5, 8}));
    ASSERT_TRUE(saved.Save(i, xs.back()).ok());
  }
  EXPECT_EQ(saved.device_bytes(), bytes) << "only the last slot stays on the device";
  EXPECT_EQ(pool.allocated_bytes(), (kSlots - 1) * bytes);
  // Backward takes slots last to first; each Take prefetches the slot before it.
  for (int64_t i = kSlots - 1; i >= 0; --i) {
    torch::Tensor x = saved.Take(i);
    EXPECT_TRUE(torch::equal(x, xs[i])) << "slot " << i;
    EXPECT_EQ(saved.device_bytes(), i > 0 ? bytes : 0) << "after Take(" << i << "): slot " << i - 1 << " prefetched";
  }
  // Without a pool everything stays where it is.
  SavedInputs resident(nullptr, 0);
  resident.BeginStep(kSlots);
  for (int64_t i = 0; i < kSlots; ++i) ASSERT_TRUE(resident.Save(i, xs[i]).ok());
  EXPECT_EQ(resident.device_bytes(), kSlots * bytes);
}

TEST(MemoryStrategyPackedTest, KeptAttentionOutputsWithPackedDocuments) {
  RunSetup setup;
  setup.doc_lens = {{20, 30}, {50}};
  const Result plain = RunStrategy(planner::MemoryStrategy{}, 1, 1, setup);
  planner::MemoryStrategy o;
  o.recompute = planner::Recompute::kLayer;
  o.keep_attention = true;
  o.offload = true;
  ExpectSameGradients(RunStrategy(o, 2, 1, setup), plain);
}

TEST_F(MemoryStrategyTest, TiledLoss) {
  planner::MemoryStrategy o;
  o.loss_tile = 13;
  ExpectSameGradients(RunStrategy(o), *plain_);
}

// Per-token logprobs in tiles equal the untiled ones, and so do their gradients for an
// arbitrary upstream gradient (what RL losses feed back).
TEST(TiledLogprobTest, MatchesUntiledWithArbitraryUpstreamGradients) {
  torch::manual_seed(9);
  torch::Tensor h = torch::randn({2, 23, 16}, torch::requires_grad());
  torch::Tensor w = (0.3 * torch::randn({41, 16})).requires_grad_(true);
  torch::Tensor y = torch::randint(0, 41, {2, 23}, torch::kInt64);
  torch::Tensor g = torch::randn({2, 23});
  torch::Tensor ref = TokenLogprobs(h, w, y);
  auto ref_grads = torch::autograd::grad({ref}, {h, w}, {g});
  const torch::Tensor& rh = ref_grads[0];
  const torch::Tensor& rw = ref_grads[1];
  torch::Tensor got = TiledTokenLogprobs(h, w, y, 5);
  auto grads = torch::autograd::grad({got}, {h, w}, {g});
  EXPECT_LT((got - ref).abs().max().item<double>(), 1e-5);
  EXPECT_LT((grads[0] - rh).norm().item<double>() / rh.norm().item<double>(), 1e-5);
  EXPECT_LT((grads[1] - rw).norm().item<double>() / rw.norm().item<double>(), 1e-5);
}

TEST_F(MemoryStrategyTest, HeadChunkedAttention) { ExpectSameGradients(RunStrategy(planner::MemoryStrategy{}, /*head_groups=*/2), *plain_); }

TEST_F(MemoryStrategyTest, EverythingTogetherOverSeveralSteps) {
  planner::MemoryStrategy o;
  o.recompute = planner::Recompute::kEveryK;
  o.every_k = 3;
  o.offload = true;
  o.mlp_tile = 16;
  o.loss_tile = 32;
  // The same batch twice with zeroed grads: the pool is reused and the result repeats.
  ExpectSameGradients(RunStrategy(o, 2, /*steps=*/2), *plain_);
}

// The hybrid family (KDA and DSA layers, the indexer KL as an auxiliary loss inside the DSA
// layers) under every strategy: the same gradients as plain autograd, the indexer's included.
model::ModelConfig HybridConfig() {
  model::ModelConfig c = model::NamedShape("hybrid-tiny").value();
  c.vocab_size = 97;
  c.hidden_size = 32;
  c.intermediate_size = 64;
  c.num_hidden_layers = 4;  // K K K D
  c.head_dim = 8;
  c.hybrid.kda_head_dim = 8;
  c.hybrid.index_head_dim = 8;
  c.hybrid.index_top_k = 8;  // 2 pools + tail of 40 positions: sparse
  c.hybrid.kda_chunk_size = 32;  // 40 positions: two chunks, the second partial
  c.hybrid.indexer_loss_weight = 0.3;
  return c;
}

RunSetup HybridSetup() {
  RunSetup s;
  s.config = HybridConfig();
  s.S = 40;
  return s;
}

class HybridMemoryStrategyTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { plain_ = new Result(RunStrategy(planner::MemoryStrategy{}, 1, 1, HybridSetup())); }
  static Result* plain_;
};
Result* HybridMemoryStrategyTest::plain_ = nullptr;

TEST_F(HybridMemoryStrategyTest, EveryParameterGetsAGradientUnderPlainAutograd) {
  for (const auto& [name, g] : plain_->grads) EXPECT_GT(g.norm().item<double>(), 0.0) << name;
}

TEST_F(HybridMemoryStrategyTest, EachStrategyGivesPlainAutogradsGradients) {
  planner::MemoryStrategy layer;
  layer.recompute = planner::Recompute::kLayer;
  ExpectSameGradients(RunStrategy(layer, 1, 1, HybridSetup()), *plain_);
  planner::MemoryStrategy nested;
  nested.recompute = planner::Recompute::kEveryK;
  nested.every_k = 3;  // groups of 3 and 1
  ExpectSameGradients(RunStrategy(nested, 1, 1, HybridSetup()), *plain_);
  planner::MemoryStrategy pairs = nested;
  pairs.every_k = 2;  // (K K) (K D): the DSA layer last in its group, its first inner pass skipped
  ExpectSameGradients(RunStrategy(pairs, 1, 1, HybridSetup()), *plain_);
  planner::MemoryStrategy offload = layer;
  offload.offload = true;
  offload.device_resident = 1;
  ExpectSameGradients(RunStrategy(offload, 1, 1, HybridSetup()), *plain_);
  planner::MemoryStrategy tiles;
  tiles.mlp_tile = 7;
  tiles.loss_tile = 13;
  ExpectSameGradients(RunStrategy(tiles, 1, 1, HybridSetup()), *plain_);
  planner::MemoryStrategy all = nested;
  all.offload = true;
  all.mlp_tile = 9;
  all.loss_tile = 11;
  ExpectSameGradients(RunStrategy(all, 1, /*steps=*/2, HybridSetup()), *plain_);
  // The DSA layers' recomputes reusing the first forward's selections; two steps: the second
  // step's forward replaces what the first kept.
  for (planner::MemoryStrategy kept : {layer, pairs, all}) {
    kept.keep_selection = true;
    ExpectSameGradients(RunStrategy(kept, 1, /*steps=*/2, HybridSetup()), *plain_);
  }
}

// keep_selection: a DSA layer's recompute selects nothing, it reuses its first forward's pools.
// The indexer's query weights change between the forward and the backward: with kept selections
// every gradient but the indexer's (which the KL computes from the changed weights) is the
// unchanged model's; scoring again in the recompute picks other pools and moves them, so the
// check can fail. Layers D K D K: in groups of 3 the first DSA layer is first in a nested group
// (a replay without grad, then the one with grad), the second last (its replay with grad only).
void ExpectTheRecomputeUsesTheFirstForwardsSelections(torch::Device device) {
  RunSetup setup = HybridSetup();
  setup.config.hybrid.layer_pattern = "DKDK";
  setup.device = device;
  const Result unchanged = RunStrategy(planner::MemoryStrategy{}, 1, 1, setup);
  setup.before_backward = [](model::CausalLMImpl& m) {
    torch::NoGradGuard no_grad;
    torch::manual_seed(9);
    for (const model::DecoderLayer& layer : m.model->layer_list) {
      if (layer->dsa) layer->dsa->indexer->wq->weight.copy_(torch::randn_like(layer->dsa->indexer->wq->weight));
    }
  };
  planner::MemoryStrategy layer;
  layer.recompute = planner::Recompute::kLayer;
  planner::MemoryStrategy nested;
  nested.recompute = planner::Recompute::kEveryK;
  nested.every_k = 3;
  nested.offload = true;
  for (const planner::MemoryStrategy& base : {layer, nested}) {
    planner::MemoryStrategy kept = base;
    kept.keep_selection = true;
    const Result got = RunStrategy(kept, 1, 1, setup), rescored = RunStrategy(base, 1, 1, setup);
    double worst = 0, apart = 0;
    for (const auto& [name, g] : unchanged.grads) {
      if (name.find(".indexer.") != std::string::npos) continue;
      const double n = g.norm().item<double>();
      // The KDA decay parameters sum S x H x K terms of both signs (see ExpectSameGradients).
      const double scale = absl::EndsWith(name, ".A_log") || absl::EndsWith(name, ".dt_bias") ? 0.1 : 1.0;
      worst = std::max(worst, scale * (got.grads.at(name) - g).norm().item<double>() / n);
      apart = std::max(apart, (rescored.grads.at(name) - g).norm().item<double>() / n);
    }
    EXPECT_LE(worst, 1e-5) << base.Describe() << ": the recompute did not reuse the forward's selections";
    EXPECT_GT(apart, 1e-3) << base.Describe() << ": scoring again would not change the gradients";
  }
}

TEST(HybridKeptSelectionTest, TheRecomputeUsesTheFirstForwardsSelections) {
  ExpectTheRecomputeUsesTheFirstForwardsSelections(torch::kCPU);
}

// On a GPU the selections go to pinned host memory and back on the compute stream.
TEST(HybridKeptSelectionGpuTest, TheRecomputeUsesTheFirstForwardsSelections) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "needs a CUDA device";
  ExpectTheRecomputeUsesTheFirstForwardsSelections(torch::kCUDA);
}

// What the strategy refuses and what a model without sparse DSA layers refuses, by name.
TEST(HybridKeptSelectionTest, NeedsRecompute) {
  planner::MemoryStrategy o;
  o.keep_selection = true;
  absl::StatusOr<std::unique_ptr<MemoryStack>> none = MemoryStack::Create(o, 4);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("memory.keep_selection needs memory.recompute"), std::string::npos)
      << none.status();
}

// LoRA: every strategy gives plain autograd's adapter gradients, and the frozen base gets none
// (the recompute's nested backward, the tiled MLP's per-tile backward and the tiled loss all run
// with frozen weights beside trainable adapters).
class LoraStrategyTest : public ::testing::Test {
 protected:
  static RunSetup Adapters() {
    RunSetup setup;
    setup.lora.rank = 3;
    setup.lora.alpha = 6;
    setup.lora.target_modules = {"q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"};
    return setup;
  }
  static void SetUpTestSuite() { plain_ = new Result(RunStrategy(planner::MemoryStrategy{}, 1, 1, Adapters())); }
  static Result* plain_;
};
Result* LoraStrategyTest::plain_ = nullptr;

TEST_F(LoraStrategyTest, PlainAutogradTrainsOnlyTheAdapters) {
  // 5 targets x (A, B) x 5 layers, each nonzero; nothing else has a gradient.
  EXPECT_EQ(plain_->grads.size(), static_cast<size_t>(5 * 2 * kLayers));
  for (const auto& [name, g] : plain_->grads) {
    EXPECT_TRUE(model::IsLoraParameter(name)) << name;
    EXPECT_GT(g.norm().item<double>(), 0.0) << name;
  }
}

TEST_F(LoraStrategyTest, LayerRecompute) {
  planner::MemoryStrategy o;
  o.recompute = planner::Recompute::kLayer;
  ExpectSameGradients(RunStrategy(o, 1, 1, Adapters()), *plain_);
  o.recompute = planner::Recompute::kEveryK;
  o.every_k = 2;
  ExpectSameGradients(RunStrategy(o, 1, 1, Adapters()), *plain_);
}

TEST_F(LoraStrategyTest, Offload) {
  planner::MemoryStrategy o;
  o.recompute = planner::Recompute::kLayer;
  o.offload = true;
  o.device_resident = 1;
  ExpectSameGradients(RunStrategy(o, 1, 1, Adapters()), *plain_);
}

TEST_F(LoraStrategyTest, TiledMlp) {
  planner::MemoryStrategy o;
  o.mlp_tile = 7;
  ExpectSameGradients(RunStrategy(o, 1, 1, Adapters()), *plain_);
  o.recompute = planner::Recompute::kLayer;  // the recompute's skipped forward tiles too
  ExpectSameGradients(RunStrategy(o, 1, 1, Adapters()), *plain_);
}

TEST_F(LoraStrategyTest, TiledLoss) {
  planner::MemoryStrategy o;
  o.loss_tile = 13;
  ExpectSameGradients(RunStrategy(o, 1, 1, Adapters()), *plain_);
}

TEST_F(LoraStrategyTest, KeptAttentionWithHeadGroups) {
  planner::MemoryStrategy o;
  o.recompute = planner::Recompute::kLayer;
  o.keep_attention = true;
  ExpectSameGradients(RunStrategy(o, /*head_groups=*/2, 1, Adapters()), *plain_);
}

TEST_F(LoraStrategyTest, EverythingTogether) {
  planner::MemoryStrategy o;
  o.recompute = planner::Recompute::kEveryK;
  o.every_k = 3;
  o.offload = true;
  o.mlp_tile = 16;
  o.loss_tile = 32;
  ExpectSameGradients(RunStrategy(o, 2, /*steps=*/2, Adapters()), *plain_);
}

// MoE layers (model/moe.h) under every strategy: the gradients of plain autograd (the one-tile
// MoE, which moe_test holds equal to a naive per-token reference), with the load-balancing
// loss in the loss; four MoE layers and a dense one (mlp_only_layers).
RunSetup MoeSetup() {
  RunSetup s;
  s.config.moe.num_experts = 6;
  s.config.moe.num_experts_per_tok = 2;
  s.config.moe.moe_intermediate_size = 24;
  s.config.moe.norm_topk_prob = true;
  s.config.moe.mlp_only_layers = {2};
  s.S = 37;
  return s;
}

TEST(MemoryStrategyMoeTest, EveryStrategyGivesPlainGradients) {
  const RunSetup setup = MoeSetup();
  const Result plain = RunStrategy(planner::MemoryStrategy{}, 1, 1, setup);
  for (const auto& [name, g] : plain.grads) EXPECT_GT(g.norm().item<double>(), 0.0) << name;
  std::vector<planner::MemoryStrategy> cases(5);
  cases[0].recompute = planner::Recompute::kLayer;
  cases[1].recompute = planner::Recompute::kEveryK;
  cases[1].every_k = 2;
  cases[2].recompute = planner::Recompute::kLayer;
  cases[2].mlp_tile = 7;  // 74 tokens: 10 full tiles and one of 4
  cases[3].mlp_tile = 7;
  cases[4].recompute = planner::Recompute::kLayer;
  cases[4].offload = true;
  cases[4].device_resident = 1;
  for (const auto& o : cases) {
    SCOPED_TRACE(o.Describe());
    ExpectSameGradients(RunStrategy(o, 1, 1, setup), plain);
  }
}

// The recompute of a checkpointed MoE layer routes as its forward did. Between the forward and
// the backward the router is perturbed (enough to flip decisions, asserted): the gradients must
// be those of the new weights at the forward's decisions (plain autograd replaying them), not
// those of a re-decided routing. Re-routing in the recompute (the leak this guards against: a
// recompute in other rounding picking other experts near a tie) fails it.
TEST(MemoryStrategyMoeTest, LayerRecomputeNeverReRoutes) {
  model::ModelConfig c = MoeSetup().config;
  c.num_hidden_layers = 1;
  c.moe.mlp_only_layers.clear();
  model::CausalLM m(c);
  m->InitRandom(11, 0.1);
  m->set_attention_backend(kernels::MakeAttentionBackend("math").value());
  model::DecoderLayer layer = m->model->layer_list[0];
  ASSERT_TRUE(layer->moe);
  torch::manual_seed(5);
  const int64_t B = 2, S = 37;
  torch::Tensor h0 = torch::randn({B, S, c.hidden_size});
  torch::Tensor r = torch::randn({B, S, c.hidden_size});  // loss = <out, r>: upstream fixed
  torch::Tensor pos = torch::arange(S, torch::kInt64).unsqueeze(0).expand({B, S});
  model::LayerContext ctx;
  ctx.rope = model::MakeRopeTables(model::RopeInvFreq(c, torch::kCPU), pos, torch::kFloat32);
  ctx.backend = &m->attention_backend();
  const torch::Tensor w0 = layer->moe->gate->weight.detach().clone();
  const torch::Tensor kick = torch::randn_like(w0) * 0.5;
  auto grads = [&](const std::function<torch::Tensor(const torch::Tensor&)>& run) {
    m->zero_grad();
    torch::Tensor h = h0.clone().requires_grad_(true);
    (run(h) * r).sum().backward();
    std::map<std::string, torch::Tensor> g;
    for (auto& p : m->named_parameters())
      if (p.value().grad().defined()) g[p.key()] = p.value().grad().clone();
    g["input"] = h.grad().clone();
    return g;
  };
  auto set_gate = [&](const torch::Tensor& w) {
    torch::NoGradGuard no_grad;
    layer->moe->gate->weight.copy_(w);
  };
  planner::MemoryStrategy o;
  o.recompute = planner::Recompute::kLayer;
  auto stack = MemoryStack::Create(o, 1);
  ASSERT_TRUE(stack.ok());
  const std::vector<model::DecoderLayer> layers = {layer};
  torch::Tensor decided;
  auto got = grads([&](const torch::Tensor& h) {
    set_gate(w0);
    torch::Tensor out = (*stack)->Runner()(layers, h, ctx);
    decided = layer->moe->routing().clone();
    set_gate(w0 + kick);  // before backward's recompute
    return out;
  });
  // Plain autograd, the new weights at the forward's decisions.
  auto replayed = grads([&](const torch::Tensor& h) {
    model::MoePassScope pass(layer->moe.get(), model::RoutingMode::kReplay, false);
    return layer->forward(h, ctx);
  });
  auto rerouted = grads([&](const torch::Tensor& h) { return layer->forward(h, ctx); });
  ASSERT_FALSE(torch::equal(layer->moe->routing(), decided)) << "the perturbation flipped no decision";
  double worst = 0, apart = 0;
  for (const auto& [name, g] : replayed) {
    const double n = g.norm().item<double>();
    auto a = got.find(name), b = rerouted.find(name);
    worst = std::max(worst, a == got.end() ? 1.0 : (a->second - g).norm().item<double>() / n);
    apart = std::max(apart, b == rerouted.end() ? 1.0 : (b->second - g).norm().item<double>() / n);
  }
  EXPECT_LE(worst, 1e-5) << "the recompute did not reuse the forward's routing";
  EXPECT_GT(apart, 1e-2) << "re-routing would not change the gradients: the check cannot fail";
}

// MoE MLPs in the hybrid family: KDA and DSA layers (the indexer KL inside the DSA layer) with
// the experts and a shared expert in every layer's MLP, the load-balancing loss in the loss;
// every strategy gives plain autograd's gradients, the routers' and the indexer's included.
TEST(MemoryStrategyMoeTest, HybridMoeLayersUnderEveryStrategy) {
  RunSetup setup = HybridSetup();
  setup.config.moe = MoeSetup().config.moe;
  setup.config.moe.mlp_only_layers = {1};  // K(dense MLP) among K K D with experts
  setup.config.moe.shared_expert_intermediate_size = 20;
  ASSERT_TRUE(setup.config.Validate().ok()) << setup.config.Validate();
  const Result plain = RunStrategy(planner::MemoryStrategy{}, 1, 1, setup);
  for (const auto& [name, g] : plain.grads) EXPECT_GT(g.norm().item<double>(), 0.0) << name;
  EXPECT_TRUE(plain.grads.count("model.layers.0.mlp.gate.weight"));
  EXPECT_TRUE(plain.grads.count("model.layers.0.mlp.shared_expert_gate.weight"));
  EXPECT_TRUE(plain.grads.count("model.layers.1.mlp.gate_proj.weight"));
  EXPECT_TRUE(plain.grads.count("model.layers.3.self_attn.indexer.wq.weight"));
  std::vector<planner::MemoryStrategy> cases(4);
  cases[0].recompute = planner::Recompute::kLayer;
  cases[1].recompute = planner::Recompute::kEveryK;
  cases[1].every_k = 3;  // groups of 3 and 1
  cases[2].recompute = planner::Recompute::kLayer;
  cases[2].mlp_tile = 7;  // 80 tokens: 11 full tiles and one of 3
  cases[2].offload = true;
  cases[2].device_resident = 1;
  cases[3].mlp_tile = 9;
  cases[3].loss_tile = 11;
  for (const auto& o : cases) {
    SCOPED_TRACE(o.Describe());
    // Tiled, the experts' outputs are summed per tile (another order): the KDA decay gradients
    // moved by up to 4.8e-5 relative (measured, 2026-12-02), every other one below 1e-5.
    ExpectSameGradients(RunStrategy(o, 1, 1, setup), plain, /*kda_decay_rtol=*/2e-4);
  }
}

TEST(MemoryStrategyOptionsTest, ValidationNamesFieldAndRule) {
  planner::MemoryStrategy o;
  EXPECT_NE(planner::ParseRecompute("sometimes").status().message().find("memory.recompute 'sometimes'"),
            std::string::npos);
  o = planner::MemoryStrategy{};
  o.offload = true;
  EXPECT_NE(o.Validate().message().find("memory.offload needs memory.recompute"), std::string::npos);
  o = planner::MemoryStrategy{};
  o.recompute = planner::Recompute::kEveryK;
  o.every_k = 1;
  EXPECT_NE(o.Validate().message().find("memory.every_k (1) must be >= 2"), std::string::npos);
  o = planner::MemoryStrategy{};
  o.keep_attention = true;
  EXPECT_NE(o.Validate().message().find("memory.keep_attention needs memory.recompute 'layer'"), std::string::npos);
  o = planner::MemoryStrategy{};
  o.bf16_moments = true;
  EXPECT_NE(o.Validate().message().find("memory.bf16_moments needs memory.optimizer_on_host"), std::string::npos);
  o.optimizer_on_host = true;
  EXPECT_TRUE(o.Validate().ok());
  EXPECT_FALSE(kernels::MakeAttentionBackend("math", 0).ok());
}

TEST(MemoryStrategyOptionsTest, HostBudgetIsEnforcedAndSaysByHowMuch) {
  planner::MemoryStrategy o;
  o.recompute = planner::Recompute::kLayer;
  o.offload = true;
  o.host_budget_bytes = 3 * 2 * 50 * 64 * 4;  // room for 3 of the 4 layer inputs it keeps (the first: recomputed)
  auto stack = MemoryStack::Create(o, 5);
  ASSERT_TRUE(stack.ok());
  absl::Status s = (*stack)->Prepare(2, 50, 64, torch::kFloat32);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("over memory.host_budget_bytes"), std::string::npos) << s;
  EXPECT_NE(s.message().find("by 0.00 GiB"), std::string::npos) << s;  // 25.6 KB over
  // Keeping the last two on the device fits: the pool holds the two between them and the first,
  // which the runner recomputes from the ids.
  o.device_resident = 2;
  stack = MemoryStack::Create(o, 5);
  ASSERT_TRUE((*stack)->Prepare(2, 50, 64, torch::kFloat32).ok());
  EXPECT_EQ((*stack)->host_pool_bytes(), 2 * 2 * 50 * 64 * 4);
}

// A slot that must grow grows by half again (so a run of slowly growing RL requests does not
// reallocate on every call), but never past the budget; a request that fits reuses the slot.
TEST(HostPoolTest, GrowingSlotsGrowGeometricallyWithinTheBudget) {
  HostPool pool(/*budget_bytes=*/1000 * 4, /*pinned=*/false);
  pool.Slot(0, 400, torch::kFloat32).value();
  EXPECT_EQ(pool.allocated_bytes(), 400 * 4);  // the first size is exact
  pool.Slot(0, 401, torch::kFloat32).value();
  EXPECT_EQ(pool.allocated_bytes(), 600 * 4);
  const void* grown = pool.Slot(0, 600, torch::kFloat32).value().data_ptr();  // fits: no new block
  EXPECT_EQ(pool.Slot(0, 550, torch::kFloat32).value().data_ptr(), grown);
  EXPECT_EQ(pool.allocated_bytes(), 600 * 4);
  pool.Slot(0, 700, torch::kFloat32).value();  // 900 wanted, the budget caps it at 1000
  EXPECT_EQ(pool.allocated_bytes(), 900 * 4);
  pool.Slot(0, 950, torch::kFloat32).value();
  EXPECT_EQ(pool.allocated_bytes(), 1000 * 4);
  EXPECT_FALSE(pool.Slot(0, 1001, torch::kFloat32).ok());
}

// A step whose backward never ran (it failed) leaves every layer's kept output recorded; the
// next step's forward starts from an empty stash instead of carrying them alongside its own.
TEST(AttentionStashTest, AStepStartsWithNothingAFailedStepRecorded) {
  const model::ModelConfig c = Config();
  model::CausalLM m(c);
  m->InitRandom(3, 0.1);
  planner::MemoryStrategy o;
  o.recompute = planner::Recompute::kLayer;
  o.keep_attention = true;
  auto stack = MemoryStack::Create(o, c.num_hidden_layers);
  ASSERT_TRUE(stack.ok()) << stack.status();
  AttentionStash* stash = (*stack)->attention_stash();
  std::vector<int64_t> seen;
  m->set_attention_backend(std::make_shared<const StashingAttention>(
      std::make_shared<const ObservedAttention>(kernels::MakeAttentionBackend("math").value(),
                                                [stash, &seen] { seen.push_back(stash->bytes()); }),
      stash));
  model::ForwardInputs in;
  in.input_ids = torch::randint(0, c.vocab_size, {1, 40}, torch::kInt64);
  m->Hidden(in, (*stack)->Runner());  // forward only: as if the step failed before backward
  const int64_t held = stash->bytes();
  EXPECT_GT(held, 0);
  seen.clear();
  m->Hidden(in, (*stack)->Runner()).sum().backward();
  ASSERT_EQ(seen.size(), static_cast<size_t>(c.num_hidden_layers));
  EXPECT_EQ(seen[0], 0) << "the first layer of the next step saw the failed step's records";
  EXPECT_EQ(seen.back(), held / c.num_hidden_layers * (c.num_hidden_layers - 1));
  EXPECT_EQ(stash->bytes(), 0);  // replayed and released by the backward
  m->Hidden(in, (*stack)->Runner());
  stash->Clear();  // what dropping the gradients does
  EXPECT_EQ(stash->bytes(), 0);
}

// The tiles' weight gradients are summed in fp32 and written to .grad once. Summed in the bf16
// .grad instead (each tile's backward adding into it), the running sum is rounded once per tile
// and its error grows with the number of tiles: with 256 tiles of one position this fails by
// several times. One layer's MLP block in bf16 against fp64 autograd on the same bf16 values.
TEST(MemoryStrategyBf16Test, TiledMlpSumsWeightGradientsInFp32) {
  model::ModelConfig c = Config();
  c.hidden_size = 128;
  c.intermediate_size = 256;
  torch::manual_seed(21);
  model::DecoderLayer layer(c), truth(c);
  layer->to(torch::kBFloat16);
  {
    torch::NoGradGuard no_grad;
    layer->post_attention_layernorm->weight.uniform_(0.5, 1.5);
    truth->to(torch::kFloat64);
    auto src = layer->named_parameters();
    for (auto& p : truth->named_parameters()) p.value().copy_(src[p.key()]);
  }
  const int64_t S = 256;
  torch::Tensor x = torch::randn({1, S, c.hidden_size}).to(torch::kBFloat16);
  torch::Tensor g = torch::randn({1, S, c.hidden_size}).to(torch::kBFloat16);
  truth->MlpBlock(x.to(torch::kFloat64).requires_grad_(true)).backward(g.to(torch::kFloat64));
  auto grads = [&](bool tiled) {
    layer->zero_grad();
    torch::Tensor xi = x.clone().requires_grad_(true);
    (tiled ? TiledMlpBlock(layer, xi, /*tile_tokens=*/1, false) : layer->MlpBlock(xi)).backward(g);
    std::map<std::string, torch::Tensor> out;
    for (auto& p : layer->named_parameters()) {
      if (p.value().grad().defined()) out[p.key()] = p.value().grad().to(torch::kFloat64);
    }
    return out;
  };
  const auto plain = grads(false), tiled = grads(true);
  auto want = truth->named_parameters();
  int checked = 0;
  for (const auto& [name, g_plain] : plain) {
    const torch::Tensor& w = want[name].grad();
    const double e_plain = (g_plain - w).norm().item<double>() / w.norm().item<double>();
    const double e_tiled = (tiled.at(name) - w).norm().item<double>() / w.norm().item<double>();
    EXPECT_LE(e_tiled, 1.5 * e_plain) << name;
    ++checked;
  }
  EXPECT_EQ(checked, 4);  // the norm weight and the three MLP weights
}

// The LM head's logits from bf16 operands on CUDA are fp32 sums never rounded to bf16 (the
// loss tiles, the per-token logprobs and the sampler read them through LogitsFp32): at a
// vocabulary's width their error against fp64 is far below the rounding a bf16 logits tensor
// carries, and so is the per-token logprob's. Under autograd the product keeps its recorded
// form (bf16, then fp32).
TEST(MemoryStrategyGpuTest, HeadLogitsAreNotRoundedTo16Bits) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  torch::manual_seed(5);
  const auto bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  const torch::Tensor h = torch::randn({3, 100, 512}, bf16), w = (0.1 * torch::randn({4000, 512}, bf16));
  const torch::Tensor y = torch::randint(0, 4000, {3, 100}, torch::TensorOptions().dtype(torch::kInt64).device(torch::kCUDA));
  const torch::Tensor truth = torch::matmul(h.to(torch::kFloat64), w.to(torch::kFloat64).t());  // (3, 100, 4000)
  const torch::Tensor ours = LogitsFp32(h, w);
  ASSERT_EQ(ours.scalar_type(), torch::kFloat32);
  ASSERT_EQ(ours.sizes(), truth.sizes());
  const torch::Tensor rounded = torch::matmul(h, w.t()).to(torch::kFloat32);
  const double ours_err = (ours.to(torch::kFloat64) - truth).abs().mean().item<double>();
  const double rounded_err = (rounded.to(torch::kFloat64) - truth).abs().mean().item<double>();
  EXPECT_LT(ours_err, 0.05 * rounded_err) << ours_err << " vs " << rounded_err;
  const torch::Tensor lp_truth = torch::log_softmax(truth, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1);
  const torch::Tensor lp = TiledTokenLogprobs(h, w, y, 64);
  const torch::Tensor lp_rounded = torch::log_softmax(rounded, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1);
  const double lp_err = (lp.to(torch::kFloat64) - lp_truth).abs().mean().item<double>();
  const double lp_rounded_err = (lp_rounded.to(torch::kFloat64) - lp_truth).abs().mean().item<double>();
  EXPECT_LT(lp_err, 0.05 * lp_rounded_err) << lp_err << " vs " << lp_rounded_err;
  // Recorded for autograd: the product in bf16 (at::mm's fp32-output form has no derivative).
  const torch::Tensor hg = h.detach().requires_grad_(true);
  const torch::Tensor recorded = LogitsFp32(hg, w);
  EXPECT_TRUE(recorded.requires_grad());
  EXPECT_TRUE(torch::equal(recorded.detach(), rounded));
}

// The same strategies on the GPU in bf16 (cuDNN attention, pinned host pool, side-stream
// copies). bf16 rounding differs between any two orders of the same math, so each strategy is
// held to the bar of the kernels: its error against an fp32 run is at most twice that of
// plain bf16 autograd (plus a hair for gradients that are near zero everywhere).
TEST(MemoryStrategyGpuTest, Bf16StrategiesAreAsAccurateAsPlainAutograd) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  RunSetup setup;
  setup.config.hidden_size = 256;
  setup.config.intermediate_size = 704;
  setup.config.num_attention_heads = 8;
  setup.config.num_key_value_heads = 4;
  setup.config.vocab_size = 1000;
  setup.B = 1;
  setup.S = 2048;
  setup.device = torch::Device(torch::kCUDA, 0);
  setup.attention = "auto";
  RunSetup fp32 = setup;
  fp32.dtype = torch::kFloat32;
  const Result ref = RunStrategy(planner::MemoryStrategy{}, 1, 1, fp32);
  setup.dtype = torch::kBFloat16;
  const Result plain = RunStrategy(planner::MemoryStrategy{}, 1, 1, setup);
  auto error = [&](const Result& r, const std::string& name) {
    return (r.grads.at(name) - ref.grads.at(name)).norm().item<double>() / ref.grads.at(name).norm().item<double>();
  };
  struct Case {
    const char* what;
    planner::MemoryStrategy o;
    int64_t groups;
  };
  std::vector<Case> cases;
  planner::MemoryStrategy o;
  o.recompute = planner::Recompute::kLayer;
  cases.push_back({"layer recompute", o, 1});
  o.offload = true;
  o.device_resident = 1;
  cases.push_back({"offload", o, 1});
  o = planner::MemoryStrategy{};
  o.recompute = planner::Recompute::kEveryK;
  o.every_k = 2;
  o.offload = true;
  cases.push_back({"nested + offload", o, 1});
  o = planner::MemoryStrategy{};
  o.mlp_tile = 300;
  o.loss_tile = 500;
  cases.push_back({"tiled mlp + loss", o, 1});
  cases.push_back({"head groups", planner::MemoryStrategy{}, 2});
  o = planner::MemoryStrategy{};
  o.recompute = planner::Recompute::kLayer;
  o.keep_attention = true;
  o.mlp_tile = 300;
  cases.push_back({"kept attention outputs (cuDNN backward alone)", o, 2});
  o.recompute = planner::Recompute::kLayer;
  o.offload = true;
  cases.push_back({"all", o, 4});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const Result got = RunStrategy(c.o, c.groups, 2, setup);
    EXPECT_NEAR(got.loss, plain.loss, 2e-2 * std::abs(plain.loss));
    for (const auto& [name, g] : ref.grads) {
      EXPECT_LE(error(got, name), 2 * error(plain, name) + 1e-3) << name;
    }
  }
  // LoRA on a frozen bf16 base: the adapters' gradients, against the fp32 run of the same model.
  setup.lora.rank = 8;
  setup.lora.alpha = 16;
  fp32.lora = setup.lora;
  const Result lora_ref = RunStrategy(planner::MemoryStrategy{}, 1, 1, fp32);
  const Result lora_plain = RunStrategy(planner::MemoryStrategy{}, 1, 1, setup);
  ASSERT_EQ(lora_ref.grads.size(), 2u * 7u * 5u);
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string("LoRA, ") + c.what);
    const Result got = RunStrategy(c.o, c.groups, 2, setup);
    ASSERT_EQ(got.grads.size(), lora_ref.grads.size());
    for (const auto& [name, g] : lora_ref.grads) {
      const double e = (got.grads.at(name) - g).norm().item<double>() / g.norm().item<double>();
      const double e_plain = (lora_plain.grads.at(name) - g).norm().item<double>() / g.norm().item<double>();
      EXPECT_LE(e, 2 * e_plain + 1e-3) << name;
    }
  }
}

}  // namespace
}  // namespace odyssey::engine::memory
