// The Mixture-of-Experts MLP (Qwen3-MoE; Qwen2-MoE with its gated shared expert; in the hybrid
// family beside KDA and DSA, with or without the shared expert), computed over sequence tiles,
// and its auxiliary load-balancing loss.
//
// Per token: p = softmax(gate(x)) in fp32, the top-k experts by p, their weights p_i (divided by
// their sum when norm_topk_prob), y = sum_i w_i * expert_i(x) with SwiGLU experts, plus
// sigmoid(shared_expert_gate(x)) * shared_expert(x) when the config has a shared expert.
// Parameter names are transformers': mlp.gate.weight, mlp.experts.{e}.{gate,up,down}_proj.weight,
// mlp.shared_expert.*, mlp.shared_expert_gate.weight.
//
// Tiles: routing, dispatch and the experts run over tiles of tile_tokens positions (0: the whole
// input as one tile). Per tile the tile's (token, slot) pairs are sorted by expert, each expert
// runs on its contiguous slice (at most tile rows: a token picks an expert once), and the
// weighted outputs are scatter-added back. So no buffer is wider than tile x intermediate, however
// uneven the routing. With grad, one autograd Function saves the input and the top-k indices
// (N, k) int32 and in backward recomputes each tile with grad on its own (the tiled MLP's pattern,
// engine/memory/checkpoint.cc), accumulating the parameters' gradients in fp32.
//
// Routing is decided once per forward and never again: each fresh forward records its top-k
// indices in the module; a pass in RoutingMode::kReplay (a layer recompute for backward) reuses
// them, so a recompute can never pick different experts than the forward did, whatever rounding
// or weight changes happened in between. The Function's backward uses the indices its forward
// used. Router probabilities are recomputed from the saved input, never carried.
//
// The load-balancing loss (MoeAuxLoss) needs the router probabilities' gradient inside each
// layer's backward, which a checkpointed layer reruns later: its backward hands each layer
// d loss / d (sum of the layer's router probabilities), (E,) fp32, which that layer's MoE
// backward adds to its tiles' graph.
// Thread safety: one thread at a time (backward may run on autograd's device thread while the
// training thread waits).
#pragma once

#include <memory>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include "model/config.h"
#include "model/layers.h"

namespace odyssey::model {

class CausalLMImpl;

enum class RoutingMode {
  kDecide,  // route afresh and record the decisions (every forward pass of a step)
  kReplay,  // reuse the decisions the last kDecide pass recorded (a recompute for backward)
};

class MoeMlpImpl : public torch::nn::Module {
 public:
  // REQUIRES config.moe.enabled() and a validated config.
  explicit MoeMlpImpl(const ModelConfig& config);

  // x (..., hidden) -> (..., hidden). Decides (and records) or replays routing per
  // routing_mode(). With output_unused() the forward tiles are skipped and an uninitialized
  // tensor returned (the caller only back-propagates through it: a layer's recompute).
  torch::Tensor forward(const torch::Tensor& x);

  // Tile length in positions; 0: the whole input as one tile. Results do not depend on it
  // beyond rounding of the parameters' fp32 gradient sums.
  void set_tile_tokens(int64_t n) { tile_tokens_ = n; }
  int64_t tile_tokens() const { return tile_tokens_; }
  void set_routing_mode(RoutingMode m) { mode_ = m; }
  RoutingMode routing_mode() const { return mode_; }
  void set_output_unused(bool v) { output_unused_ = v; }
  bool output_unused() const { return output_unused_; }

  // The last kDecide pass's decisions: (N, k) int32 expert indices, N = its tokens; undefined
  // before one. Replaced by the next kDecide pass (8 bytes per token for k = 2).
  const torch::Tensor& routing() const { return routing_; }
  // Of the last kDecide pass: routing slots per expert (E,) int64 and the sum over its tokens
  // of the router probabilities (E,) fp32, both detached; its token count.
  const torch::Tensor& expert_counts() const { return counts_; }
  const torch::Tensor& prob_sum() const { return prob_sum_; }
  int64_t routed_tokens() const { return routed_tokens_; }
  // d loss / d prob_sum (E,) fp32, set by MoeAuxLoss's backward for this forward's backward;
  // cleared by every kDecide pass, so one step's never reaches another's.
  void set_aux_grad(torch::Tensor g) { aux_grad_ = std::move(g); }
  const torch::Tensor& aux_grad() const { return aux_grad_; }

  // One tile: x (n, hidden), top-k indices idx (n, k) int64 -> y (n, hidden); *probs (if not
  // null) gets the router probabilities (n, E) fp32. Differentiable when grad is on.
  torch::Tensor Tile(const torch::Tensor& x, const torch::Tensor& idx, torch::Tensor* probs);
  // The parameters the tiles use (router, experts, shared expert), for gradient accumulation.
  std::vector<torch::Tensor> TileParameters();

  torch::nn::Linear gate{nullptr};
  torch::nn::ModuleList experts{nullptr};
  std::vector<Mlp> expert_list;                // typed handles into `experts`
  Mlp shared_expert{nullptr};                  // Qwen2-MoE only
  torch::nn::Linear shared_expert_gate{nullptr};  // (1, hidden), Qwen2-MoE only

  int64_t num_experts() const { return num_experts_; }
  int64_t top_k() const { return top_k_; }

 private:
  // Decides routing for flat (N, hidden) tile by tile, without grad; fills routing_ and stats.
  void Route(const torch::Tensor& flat);

  int64_t num_experts_, top_k_;
  bool norm_topk_prob_;
  int64_t tile_tokens_ = 0;
  RoutingMode mode_ = RoutingMode::kDecide;
  bool output_unused_ = false;
  torch::Tensor routing_;   // (N, k) int32
  torch::Tensor counts_;    // (E,) int64
  torch::Tensor prob_sum_;  // (E,) fp32
  int64_t routed_tokens_ = 0;
  torch::Tensor aux_grad_;  // (E,) fp32 or undefined
};
TORCH_MODULE(MoeMlp);

// Sets a layer's MoE MLP (if it has one) for one pass and restores the defaults (kDecide, tile
// kept, output used) when it goes out of scope. A no-op for a dense layer.
class MoePassScope {
 public:
  MoePassScope(MoeMlpImpl* moe, RoutingMode mode, bool output_unused);
  ~MoePassScope();
  MoePassScope(const MoePassScope&) = delete;
  MoePassScope& operator=(const MoePassScope&) = delete;

 private:
  MoeMlpImpl* moe_;
};

// The MoE MLPs of a model's layers, in layer order (empty for a dense model).
std::vector<std::shared_ptr<MoeMlpImpl>> MoeLayers(CausalLMImpl& model);

// router_aux_loss_coef * transformers' load_balancing_loss_func over the last forward of every
// layer in `layers` (their tokens concatenated): coef * E * sum_e f_e * P_e, f_e the fraction of
// routing slots that chose expert e, P_e its mean router probability. fp32 scalar. `anchor` is a
// tensor of that forward's graph downstream of every layer (the final hidden state): the loss's
// backward runs before the layers' and hands each its gradient (see the file comment).
// REQUIRES a forward since the layers' last backward; `layers` non-empty.
torch::Tensor MoeAuxLoss(const std::vector<std::shared_ptr<MoeMlpImpl>>& layers, double coef,
                         const torch::Tensor& anchor);

// Routing slots per expert over `layers`' last forward, summed over the layers (E values).
std::vector<int64_t> MoeExpertTokens(const std::vector<std::shared_ptr<MoeMlpImpl>>& layers);

}  // namespace odyssey::model
