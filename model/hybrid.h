// The token mixers of the hybrid family (ModelConfig::hybrid, ../shared/specs/hybrid-attention.md):
// Kimi Delta Attention (spec 1.1, computed by kernels::KdaChunked) and DeepSeek Sparse Attention
// with GLM-5.3-Flash's pooled-key lightning indexer (spec 2, kernels/dsa.h), plus the indexer's
// KL loss (spec 2.3). A DecoderLayer holds one of them in place of the dense Attention, under the
// same name (`self_attn`), so the engine's strategies (recompute, offload, tiled MLP and loss)
// wrap hybrid layers exactly as dense ones.
//
// Parameter names (the tensor names of checkpoints) follow the public Kimi-Linear layer for KDA
// and DeepSeek-V3.2's indexer where those exist; model/README.md lists them.
//
// Packed rows (AttentionMeta::doc_lens) run document by document: the short convolution, the
// KDA state and the DSA pools restart at every document (pools count from its first token).
// Thread safety: modules are used by one thread at a time.
#pragma once

#include <optional>

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <string>
#include <vector>

#include "model/attention.h"
#include "model/config.h"
#include "model/lora_adapter.h"
#include "model/sequence_group.h"

namespace odyssey::model {

class RMSNormImpl;  // model/layers.h

// Depthwise causal 1-d convolution over the sequence (no bias): weight (C, 1, kernel), as a
// Conv1d with groups = C stores it; output t sees inputs t-kernel+1..t. The module holds the
// weight (its checkpoint name); the KDA mixer applies it with its SiLU through
// kernels::ShortConvSilu (the one definition of the convolution, CPU and GPU).
class ShortConvImpl : public torch::nn::Module {
 public:
  ShortConvImpl(int64_t channels, int64_t kernel);
  torch::Tensor weight;
};
TORCH_MODULE(ShortConv);

// RMSNorm over the last dimension in fp32, cast back, then scaled (the per-head output norm).
class HeadRMSNormImpl : public torch::nn::Module {
 public:
  HeadRMSNormImpl(int64_t dim, double eps);
  torch::Tensor forward(const torch::Tensor& x);  // (..., dim) -> (..., dim)
  torch::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(HeadRMSNorm);

// KDA (spec 1.1) with H = HV heads of dim K = V:
//   q, k = L2norm(SiLU(conv(q_proj x))), v = SiLU(conv(v_proj x))
//   g    = lb * sigmoid(exp(A_log) * (f_b_proj(f_a_proj x) + dt_bias))   in (lb, 0), fp32
//   beta = sigmoid(b_proj x)
//   o    = KDA(q, k, v, g, beta) (chunked, C = kda_chunk_size), then
//          o_proj(o_norm(o) * sigmoid(g_b_proj(g_a_proj x)))
// A_log (H,) and dt_bias (H K,) stay fp32 whatever dtype the model is moved to; being 1-d, AdamW
// applies no weight decay to them.
class KdaAttentionImpl : public torch::nn::Module {
 public:
  explicit KdaAttentionImpl(const ModelConfig& config);
  // Everything before o_proj: (B, S, hidden) -> (B, S, H * K). Documents longer than tile()
  // tokens run in sequence tiles with the KDA state carried from one to the next (the short
  // convolution reading the kernel - 1 tokens before each tile): without grad tile by tile; with
  // grad through a Function that keeps only x and the state entering each tile and, in
  // backward, recomputes and back-propagates one tile at a time from the last (the state's
  // gradient handed back), the weight gradients summed over tiles in fp32 (model/grad_sums.h).
  // Its working memory is one tile's, not the sequence's (~200 KB a token for hybrid-3b).
  //
  // Context parallelism (`group` given, of P ranks; x is this rank's S/P positions, rank r's
  // the r-th block): the ranks split the heads, Ulysses-style, but what travels is the layer's
  // input, not its projections. The sequence runs tile by tile in order, each tile broadcast by
  // the rank that holds it (with the kernel - 1 tokens before it, so the convolution needs no
  // other halo); every rank computes its H/P heads of every tile with its rows of the per-head
  // weights (the low-rank down projections in full) and carries its heads' state; one
  // all-to-all at the end trades the head split back for the sequence split. Backward redoes the
  // tiles from the last, each rank's partial gradient of a tile's input summed over the ranks for
  // the rank that holds it; a rank's weight gradients are those of its heads' rows (zero
  // elsewhere), which the step's sum over the group completes. Saved: x and the states entering
  // the tiles, as without it. REQUIRES: P divides the heads; every rank passes the same shape;
  // rows are not packed.
  torch::Tensor Heads(const torch::Tensor& x, const AttentionMeta& meta, const SequenceGroup* group = nullptr);
  // Tokens per sequence tile (0: never tiled). Default kDefaultTile.
  static constexpr int64_t kDefaultTile = kKdaTile;
  int64_t tile() const { return tile_; }
  void set_tile(int64_t tokens) { tile_ = tokens; }
  // Tokens per segment of the chunked KDA op inside a tile (kernels::KdaOptions::segment, a
  // positive multiple of the chunk size): its backward holds one segment's fp32 intermediates,
  // ~0.6 MB a token for hybrid-3b (measured on one H200). Default kDefaultSegment.
  static constexpr int64_t kDefaultSegment = kKdaSegment;
  int64_t segment() const { return segment_; }
  void set_segment(int64_t tokens);
  // The chunked op's C (the config's kda_chunk_size).
  int64_t chunk_size() const { return chunk_; }
  // One tile: x_ctx (B, ctx + n, hidden), its first ctx tokens only context for the convolution;
  // h0 (B, Hn, K, K) fp32 the entering state (undefined: zero). Returns the n tokens' heads
  // (B, n, Hn * K) and sets *h_out to the state after the tile. Heads [first_head, first_head +
  // Hn) only, Hn = num_heads (-1: all H), through those heads' rows of the per-head weights.
  torch::Tensor TileHeads(const torch::Tensor& x_ctx, int64_t ctx, const torch::Tensor& h0, torch::Tensor* h_out,
                          int64_t first_head = 0, int64_t num_heads = -1);
  int64_t conv_context() const { return conv_kernel_ - 1; }
  int64_t num_heads() const { return heads_; }
  // The spec's initialisation of what a generic init cannot know: conv weights, A_log, dt_bias.
  // `gen`: the generator InitRandom draws from (none: the process generator).
  void InitSpecial(const std::optional<at::Generator>& gen);
  // Keeps A_log and dt_bias fp32 when the module is converted.
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;

  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  LoraAdapter q_lora, k_lora, v_lora, o_lora;  // set by AttachLora (the low-rank gate projections have none)
  ShortConv q_conv1d{nullptr}, k_conv1d{nullptr}, v_conv1d{nullptr};
  torch::nn::Linear f_a_proj{nullptr}, f_b_proj{nullptr}, b_proj{nullptr}, g_a_proj{nullptr}, g_b_proj{nullptr};
  HeadRMSNorm o_norm{nullptr};
  torch::Tensor A_log, dt_bias;

 private:
  torch::Tensor HeadsOfDocument(const torch::Tensor& x);  // x (1 or B, S, hidden): one document per row
  void RestoreFp32(const torch::Tensor& a_log, const torch::Tensor& dt_bias);
  int64_t heads_, head_dim_, chunk_, conv_kernel_;
  double lower_bound_;
  int64_t tile_ = kDefaultTile;
  int64_t segment_ = kDefaultSegment;
};
TORCH_MODULE(KdaAttention);

// DSA's lightning indexer with GLM-5.3-Flash's pools of 4 keys (spec 2.1, 2.4), NoPE:
//   q^I = wq x (HI heads of DI), k^I = k_norm(wk x) (LayerNorm), w = weights_proj(x) HI^-1/2,
//   pooled keys K = KeyPool4(k^I, pool_gate x, pool_bias).
class DsaIndexerImpl : public torch::nn::Module {
 public:
  explicit DsaIndexerImpl(const ModelConfig& config);
  struct Out {
    torch::Tensor q;     // (B, HI, S, DI)
    torch::Tensor keys;  // (B, floor(S / 4), DI) pooled
    torch::Tensor w;     // (B, S, HI)
  };
  Out forward(const torch::Tensor& x);  // x (B, S, hidden)
  // The parts of forward() a query tile needs: its queries and head weights from its own rows,
  // and the pooled keys of the whole sequence.
  void Queries(const torch::Tensor& x, torch::Tensor* q, torch::Tensor* w);  // (B, HI, n, DI), (B, n, HI)
  torch::Tensor Keys(const torch::Tensor& x);                                 // (B, floor(S / 4), DI)
  torch::nn::Linear wq{nullptr}, wk{nullptr}, weights_proj{nullptr}, pool_gate{nullptr};
  torch::nn::LayerNorm k_norm{nullptr};
  torch::Tensor pool_bias;  // (4, DI)

 private:
  int64_t heads_, head_dim_;
};
TORCH_MODULE(DsaIndexer);

// DSA layer (spec 2): GQA attention (num_attention_heads / num_key_value_heads x head_dim, no
// RoPE) over the keys the indexer selects: top index_top_k / 4 pools expanded to their tokens,
// plus the tail (kernels::SparseAttention); rows of at most index_top_k + 3 tokens are dense
// causal attention exactly. With indexer_stage dense_warmup the main attention is dense causal
// (the context's backend) instead, and the trainer trains the indexers alone (engine/trainer.cc).
// The indexer's input is detached: it learns only from its KL loss (spec 2.3), which Heads()
// returns for the engine to add (see InjectAuxLoss): the target is the main attention's
// probabilities summed over heads (L1-normalised) and summed within each pool, against the
// softmax of the indexer's pool scores, over the selected pools (sparse) or every visible pool
// (dense_warmup), summed per query row and divided by the rows that have a pool.
//
// The sparse stage runs in query tiles of tile() tokens (the whole sequence's keys, values and
// pooled indexer keys against one tile's queries at a time), so what grows with the sequence is
// per key, not per query. With grad it goes through a Function that keeps x, each query's pool
// selection, the attention's log-sum-exp and the KL's target (~4 KB a token for hybrid-3b) and,
// in backward, recomputes k and v without a graph (per KV-head group: set_head_groups) and the
// pooled keys once, then the tiles from the last, each with its own q, k and v projections and
// token indices: a tile's key-side gradients, summed over the query tiles in fp32
// (kernels::SparseAttentionBackward), are final once its own queries are done (causal) and go
// back through its projections in the same gradient call as its queries'. The weight gradients
// sum in fp32 too (model/grad_sums.h); nothing (T, hidden) wide is made but the input's gradient. Neither the indexer nor the attention runs
// forward again in backward.
class DsaAttentionImpl : public torch::nn::Module {
 public:
  explicit DsaAttentionImpl(const ModelConfig& config);
  // Queries per tile of the sparse stage (a positive number). Default kDsaTile.
  static constexpr int64_t kDefaultTile = kDsaTile;
  int64_t tile() const { return tile_; }
  void set_tile(int64_t tokens);
  // KV-head groups the sparse stage's backward runs one after another (the memory stack's
  // head_groups; default 1). Each group holds the whole sequence's keys and values of its
  // Hkv / groups KV heads and their fp32 gradient accumulators, where one group holds all of
  // them: 2 Hkv D (4 + dtype bytes) a token over `groups` (hybrid-3b: 12 KB a token at 1, 1.5 KB
  // at 8). Each group projects its own heads' rows of q, k and v, so the projections' work is
  // the same; the tiles' selections are expanded once per group, and the sparse attention's
  // backward runs on each group's heads alone (hybrid-3b at 768K on an H100: 15% slower in 8
  // groups, 3% of the step). The indexer's KL runs once.
  // REQUIRES: groups divides the KV heads; one rank per sequence (Heads refuses a group of ranks
  // with more than one head group).
  int64_t head_groups() const { return head_groups_; }
  void set_head_groups(int64_t groups);
  // Everything before o_proj: (B, S, hidden) -> (B, S, Hq * D). When `indexer_loss` is given and
  // the loss can train (grad mode on, the indexer's parameters require grad, weight > 0), it is
  // set to the indexer KL (fp32 scalar, differentiable w.r.t. the indexer's parameters only);
  // otherwise left undefined.
  //
  // Context parallelism (`group` given, of P ranks; x is this rank's S/P positions): the
  // sequence's query tiles (a multiple of P tokens) run in order on every rank, each tile's input
  // broadcast by the rank that holds it. Each rank selects the pools of its 1/P of the tile's
  // queries (the indexer against the pooled keys all-gathered from the ranks: the scoring, whose
  // cost grows with the position, split evenly) and the parts are all-gathered; each rank then
  // computes its H/P query heads and Hkv/P KV heads (the KV heads those queries use) against its
  // heads' keys and values of the whole sequence; the KL's target sums the ranks' heads (an
  // all-reduce per tile) and each rank computes the KL of its part of the rows, divided by the
  // whole sequence's rows so that the ranks' losses add up to it. One all-to-all at the end
  // trades the head split back. Backward: the same tiles from the last, each rank's partial
  // gradient of a tile's input summed for the rank that holds it, the indexer's pooled-key
  // gradient summed over the ranks; a rank's weight gradients are its heads' rows (zero
  // elsewhere) and its rows' indexer terms, completed by the step's sum over the group. The
  // memory per rank is the one-rank layer's at S/P tokens, plus one tile's input.
  // REQUIRES: P divides the query and KV heads; 4 divides S/P (pools and their bias slots count
  // from the sequence's first token); the sparse indexer stage; rows are not packed.
  //
  // With `input_norm` x is the layer's input before that norm (the decoder layer's
  // input_layernorm), and the result is that of Heads(input_norm(x)). In the sparse stage on one
  // rank with grad, the norm runs inside the tiled Function: its backward keeps x, which the
  // layer holds anyway, where it kept the norm's output, one (T, hidden) more for the whole
  // backward, and normalizes a tile of rows at a time (the norm's weight gradient summed over
  // the tiles). Elsewhere the norm runs first.
  torch::Tensor Heads(const torch::Tensor& x, const AttentionMeta& meta, const AttentionBackend* backend,
                      torch::Tensor* indexer_loss, const SequenceGroup* group = nullptr,
                      RMSNormImpl* input_norm = nullptr);
  void InitSpecial(const std::optional<at::Generator>& gen);  // draws nothing today
  // Keeping the sparse stage's pool selections between a layer's passes of one step (the memory
  // stack's keep_selection, engine/memory/strategy.h). kRecord: select afresh and keep each
  // document's selection (B, S, index_top_k / 4) int32, 2 KB a token for hybrid-3b, in pinned
  // host memory when the layer runs on a GPU; it replaces what an earlier pass kept. kReplay:
  // reuse the kept selections in the order they were kept (each replay pass starts at the first),
  // so the pass runs no indexer scoring, the part of the layer that grows with the sequence
  // squared; a replay with grad is the last use of a selection and releases it. kOff (the
  // default): select afresh, keep nothing. The dense warm-up stage selects nothing and ignores it.
  enum class SelectionMode { kOff, kRecord, kReplay };
  void set_selection_mode(SelectionMode mode);
  SelectionMode selection_mode() const { return selection_mode_; }
  // Bytes of the selections kept now; releases them all.
  int64_t kept_selection_bytes() const;
  void ClearSelections() { kept_.clear(); }
  // The indexer KL of the last forward that computed it (detached), undefined before.
  const torch::Tensor& last_indexer_loss() const { return last_loss_; }
  double indexer_loss_weight() const { return loss_weight_; }
  // The share of the KL's gradient this rank's pass carries (default 1): under data parallelism
  // 1 / the replicas, so that the replicas' KLs enter as the mean over their batches, as the LM
  // loss does (the trainer sets it). The gradient is indexer_loss_weight() * gradient_scale().
  void set_gradient_scale(double scale) { gradient_scale_ = scale; }
  double gradient_scale() const { return gradient_scale_; }
  // The dense warm-up's step when every weight but the indexers is frozen (the trainer's): with
  // it on, a forward whose indexer trains (loss weight > 0, an indexer weight requiring grad)
  // differentiates the KL inside the layer, grad mode on or off, adds its gradient (the loss
  // weight x the gradient scale) to the indexer's .grad at once, and leaves the layer's output
  // without it (Heads sets no indexer_loss). The step then needs no backward through the layers
  // and so no recompute: its forward can run without grad. last_indexer_loss() as before.
  // REQUIRES: the dense_warmup stage, one rank per sequence (Heads refuses it otherwise).
  void set_indexer_backward_in_forward(bool on) { backward_in_forward_ = on; }
  bool indexer_backward_in_forward() const { return backward_in_forward_; }

  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  LoraAdapter q_lora, k_lora, v_lora, o_lora;  // set by AttachLora (the indexer has none: frozen with the base)
  DsaIndexer indexer{nullptr};

 private:
  struct Kl {
    torch::Tensor sum;  // fp32 scalar: KL summed over query rows
    int64_t rows = 0;   // rows with at least one pool
  };
  class TiledFunction;
  class ShardedFunction;
  // proj(x) for x (B, S, hidden) split into heads of head_dim: (B, heads, S, head_dim), a view.
  torch::Tensor SplitHeads(const torch::nn::Linear& proj, const LoraAdapter& lora, const torch::Tensor& x);
  torch::Tensor HeadsOfDocument(const torch::Tensor& x, const AttentionBackend* backend, Kl* kl, RMSNormImpl* norm);
  // Whether the indexer's KL is built with grad: grad mode on, or its backward in the forward.
  bool KlGrad() const { return torch::GradMode::is_enabled() || backward_in_forward_; }
  // The sparse stage over query tiles: without grad directly, with grad through TiledFunction;
  // with a group of more than one rank, through ShardedFunction.
  // With `norm` (one rank, grad on) x is the norm's input (Heads' input_norm).
  torch::Tensor SparseHeads(const torch::Tensor& x, Kl* kl, const SequenceGroup* group = nullptr,
                            RMSNormImpl* norm = nullptr);
  int64_t heads_, kv_heads_, head_dim_, top_pools_;
  int64_t tile_ = kDefaultTile;
  int64_t head_groups_ = 1;
  SelectionMode selection_mode_ = SelectionMode::kOff;
  std::vector<torch::Tensor> kept_;  // one per document of the last kRecord pass
  size_t replay_cursor_ = 0;
  IndexerStage stage_;
  double loss_weight_;
  double gradient_scale_ = 1.0;
  bool backward_in_forward_ = false;
  torch::Tensor last_loss_;
};
TORCH_MODULE(DsaAttention);

// Sets a DSA layer's selection mode for one pass and restores kOff when it goes out of scope. A
// no-op for a null layer (a KDA or dense layer).
class DsaSelectionScope {
 public:
  DsaSelectionScope(DsaAttentionImpl* dsa, DsaAttentionImpl::SelectionMode mode) : dsa_(dsa) {
    if (dsa_ != nullptr) dsa_->set_selection_mode(mode);
  }
  ~DsaSelectionScope() {
    if (dsa_ != nullptr) dsa_->set_selection_mode(DsaAttentionImpl::SelectionMode::kOff);
  }
  DsaSelectionScope(const DsaSelectionScope&) = delete;
  DsaSelectionScope& operator=(const DsaSelectionScope&) = delete;

 private:
  DsaAttentionImpl* dsa_;
};

// Returns `out` unchanged; its backward passes out's gradient through and gives `aux` (a scalar)
// the gradient `weight`, as if `weight * aux` were added to the loss. So an auxiliary loss
// computed inside a layer trains wherever that layer's backward runs: under plain autograd, and
// inside a recompute's backward (which reruns the layer and so recomputes the loss).
torch::Tensor InjectAuxLoss(const torch::Tensor& out, const torch::Tensor& aux, double weight);

// Parameters a checkpoint keeps in fp32 whatever dtype the rest is saved in (A_log, dt_bias).
bool IsFp32Parameter(const std::string& name);

}  // namespace odyssey::model
