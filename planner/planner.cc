#include "planner/planner.h"

#include <algorithm>
#include <bit>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "model/config.h"

namespace odyssey::planner {
namespace {

using Terms = std::vector<std::pair<std::string, int64_t>>;

// The step's peak: the persistent terms plus the largest phase's. Sets p's gpu_peak_bytes,
// peak_phase and terms (the nonzero ones, persistent first).
void TakePeak(const Terms& persistent, const std::vector<std::pair<std::string, Terms>>& phases, Prediction& p) {
  int64_t base = 0;
  for (const auto& [name, bytes] : persistent) base += bytes;
  int64_t best = -1;
  for (const auto& [name, terms] : phases) {
    int64_t sum = base;
    for (const auto& [term, bytes] : terms) sum += bytes;
    if (sum > best) {
      best = sum;
      p.peak_phase = name;
      p.terms = persistent;
      for (const auto& [term, bytes] : terms) {
        if (bytes > 0) p.terms.emplace_back(term, bytes);
      }
    }
  }
  p.gpu_peak_bytes = best;
}

// A CPU rank's "device" and "host" are one memory: what a spec's offload puts in the pool
// counts against the same budget.
bool Fits(const Prediction& p, const Hardware& hw) {
  return hw.cpu ? p.gpu_peak_bytes + p.host_bytes <= hw.gpu_bytes
                : p.gpu_peak_bytes <= hw.gpu_bytes && p.host_bytes <= hw.host_bytes;
}

std::string GiB(int64_t b) { return absl::StrFormat("%.1f GiB", static_cast<double>(b) / (int64_t{1} << 30)); }

// Fixed allocator-visible overhead: cuBLAS/cuDNN workspaces, RoPE tables, small buffers
// (~0.1 GB in the peaks measured on one H200; a quarter GiB leaves room).
constexpr int64_t kOverhead = int64_t{1} << 28;

struct Search {
  Choice best;           // the first candidate that fits, else the one that misses by least
  bool fits = false;
  bool any_valid = false;  // some candidate was valid with the fixed fields on this model
  int64_t over = -1;     // by how much `best` misses (bytes; -1 when it fits)
};

// Why nothing fits when the planner was free: the least-bad candidate and by how much it misses.
std::string NothingFits(int64_t seq_len, int64_t batch_size, const Search& found, const Hardware& hw) {
  if (hw.cpu) {
    return absl::StrCat("does not fit: ", seq_len, " tokens x ", batch_size, " needs at least ",
                        GiB(found.best.prediction.gpu_peak_bytes + found.best.prediction.host_bytes),
                        " of host memory on a CPU worker with the best "
                        "strategy (", found.best.strategy.Describe(), "), over the ", GiB(hw.gpu_bytes),
                        " a CPU rank may use there by ", GiB(found.over));
  }
  return absl::StrCat("does not fit: ", seq_len, " tokens x ", batch_size, " needs at least ",
                      GiB(found.best.prediction.gpu_peak_bytes), " of GPU memory and ",
                      GiB(found.best.prediction.host_bytes), " of pinned host memory with the best strategy (",
                      found.best.strategy.Describe(), "), over the machine's ", GiB(hw.gpu_bytes), " GPU / ",
                      GiB(hw.host_bytes), " host by ", GiB(found.over));
}

// Why a strategy the job's fields decided (wholly or in part) does not fit.
std::string StrategyMisses(int64_t seq_len, int64_t batch_size, const MemoryStrategy& s, const Prediction& p,
                           const Hardware& hw) {
  if (hw.cpu) {
    return absl::StrCat("does not fit: the strategy needs ", GiB(p.gpu_peak_bytes + p.host_bytes),
                        " of host memory on a CPU "
                        "worker; a CPU rank may use ", GiB(hw.gpu_bytes), " there (", seq_len, " tokens x ",
                        batch_size, ", ", s.Describe(), ")");
  }
  return absl::StrCat("does not fit: the strategy needs ", GiB(p.gpu_peak_bytes), " of GPU memory and ",
                      GiB(p.host_bytes), " of pinned host memory; the machine has ", GiB(hw.gpu_bytes), " / ",
                      GiB(hw.host_bytes), " (", seq_len, " tokens x ", batch_size, ", ", s.Describe(), ")");
}

Request RequestFor(const ModelShape& model, int64_t seq_len, int64_t batch_size, const Hardware& hw,
                   int64_t param_bytes) {
  Request r;
  r.model = model;
  r.seq_len = seq_len;
  r.batch_size = batch_size;
  r.hardware = hw;
  r.param_bytes = param_bytes;
  return r;
}

}  // namespace

ModelShape ShapeOf(const model::ModelConfig& c, const model::LoraConfig& lora) {
  ModelShape m;
  m.layers = c.num_hidden_layers;
  m.hidden = c.hidden_size;
  m.intermediate = c.intermediate_size;
  m.heads = c.num_attention_heads;
  m.kv_heads = c.num_key_value_heads;
  m.head_dim = c.HeadDim();
  m.vocab = c.vocab_size;
  m.params = c.NumParameters();
  m.largest = std::max({c.vocab_size * c.hidden_size, c.intermediate_size * c.hidden_size,
                        c.num_attention_heads * c.HeadDim() * c.hidden_size});
  m.qk_norm = c.QkNorm();
  if (c.IsHybrid()) {
    m.hybrid = true;
    m.kda_layers = c.NumLayersOfKind('K');
    m.dsa_layers = c.NumLayersOfKind('D');
    m.kda_heads = c.hybrid.kda_num_heads;
    m.kda_head_dim = c.hybrid.kda_head_dim;
    m.kda_chunk = c.hybrid.kda_chunk_size;
    m.index_heads = c.hybrid.index_num_heads;
    m.index_head_dim = c.hybrid.index_head_dim;
    m.index_top_k = c.hybrid.index_top_k;
    m.dsa_sparse = m.dsa_layers > 0 && c.hybrid.indexer_stage == model::IndexerStage::kSparse;
    m.largest = std::max(m.largest, m.kda_heads * m.kda_head_dim * c.hidden_size);
  }
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) m.moe_layers += c.moe.IsMoeLayer(i) ? 1 : 0;
  if (m.moe_layers > 0) {
    m.experts = c.moe.num_experts;
    m.top_k = c.moe.num_experts_per_tok;
    m.moe_intermediate = c.moe.moe_intermediate_size;
    m.shared_intermediate = c.moe.shared_expert_intermediate_size;
  }
  if (c.InDenseWarmup() && !lora.enabled()) {
    m.warmup_params = c.IndexerParameters();
    m.warmup_largest = c.hidden_size * c.hybrid.index_num_heads * c.hybrid.index_head_dim;  // wq
  }
  if (lora.enabled()) {
    m.lora_params = lora.NumParameters(c);
    // B of gate/up (intermediate x rank) or of q (heads x head_dim x rank) is the largest.
    m.lora_largest = lora.rank * std::max({c.intermediate_size, c.hidden_size, c.num_attention_heads * c.HeadDim()});
  }
  return m;
}

// The host optimizer's pageable state a parameter: the fp32 master and the two moments, fp32 or
// bf16 (engine/host_adamw.h).
namespace {
int64_t HostStateBytes(const MemoryStrategy& st) { return st.bf16_moments ? 4 + 2 + 2 : 12; }
}  // namespace

Prediction Predict(const Request& r) {
  const ModelShape& m = r.model;
  const MemoryStrategy& st = r.strategy;
  const int64_t e = r.param_bytes;
  const int64_t T = r.seq_len * r.batch_size;
  const int64_t H = m.hidden, I = m.intermediate, qd = m.heads * m.head_dim, kvd = m.kv_heads * m.head_dim;
  const int64_t L = std::max<int64_t>(1, m.layers);
  const int64_t groups = std::max<int64_t>(1, st.head_groups);
  const bool recompute = st.recompute != Recompute::kNone;
  const bool keep = st.keep_attention && st.recompute == Recompute::kLayer;
  const int64_t act = T * H * e;  // one (T, hidden) activation
  Prediction p;

  // Persistent through the step: the parameters and, with the optimizer on the device, its
  // fp32 state (master + two moments in bf16 training; fp32 training has no master).
  // With LoRA the base is frozen: its params only; the adapters (in the params' dtype) carry
  // the optimizer state, and only they (not the head) get gradients. Sharded: this rank's 1/P
  // of the parameters and their state, and the whole weights of the units in use (LoRA with
  // sharding is refused by CreateJob; the terms still add up).
  // The dense warm-up trains the indexers alone: no gradient or optimizer state for the rest,
  // the head's included (sharding is refused with it, as with LoRA).
  const bool lora = m.lora_params > 0, frozen = m.Frozen();
  const int64_t shards = std::max<int64_t>(1, m.shard_ranks);
  const int64_t owned = (m.params + shards - 1) / shards;    // parameters this rank keeps
  const int64_t trainable = frozen ? m.Trainable() : owned;  // what this rank's optimizer updates
  // One layer's trainable parameters (the warm-up's: a DSA layer's indexer).
  const int64_t layer_params = lora     ? m.lora_params / L
                               : frozen ? m.warmup_params / std::max<int64_t>(1, m.dsa_layers)
                                        : (m.params - m.vocab * H) / L;
  Terms persistent;
  persistent.emplace_back(lora                ? "params (frozen base)"
                          : frozen            ? "params (frozen but the DSA indexers)"
                          : shards > 1        ? "params (this rank's shard)"
                                              : "params",
                          owned * e);
  if (lora) persistent.emplace_back("LoRA adapters", m.lora_params * e);
  if (shards > 1)
    persistent.emplace_back("whole params in use (embedding, head, two layers)",
                            (2 * m.vocab * H + 2 * ((m.params - m.vocab * H) / L)) * e);
  if (!st.optimizer_on_host) {
    persistent.emplace_back(e == 4 ? "optimizer state (fp32 moments)" : "optimizer state (fp32 master and moments)",
                            trainable * (e == 4 ? 8 : 12));
  }
  persistent.emplace_back("workspaces and small buffers", kOverhead);

  // Checkpointed layer inputs: C of them. The first (the embedding of the ids) is not kept: its
  // group's backward recomputes it (engine/memory/strategy.cc). Of the other C - 1, `on_gpu`
  // stay on the device (the last ones), the rest in pinned host memory. Backward frees each as
  // its layer is done, so the GPU holds them all only at the top of backward; an offloaded input
  // comes back with the next one prefetched (none below the second group: the first is
  // recomputed).
  // (With r.keeps_first_input the first is kept like the others and prefetched for the bottom
  // group.)
  const bool first_kept = r.keeps_first_input;
  const int64_t C = st.NumCheckpoints(L), kept = first_kept ? C : std::max<int64_t>(C - 1, 0);
  const int64_t on_gpu = recompute ? (st.offload ? std::min(st.device_resident, kept) : kept) : 0;
  p.host_bytes = recompute && st.offload ? (kept - on_gpu) * act : 0;
  // At the top: the resident inputs, or the top group's own and the one below it, prefetched.
  // Nested groups (every_k, k >= 2) start that copy at their bottom layer's backward, once the
  // k - 1 inputs of the layers above it are freed (engine/memory/strategy.cc): their top layer
  // runs beside its own input alone, and the bottom layer holds its own and the prefetched one
  // where k - 1 >= 1 inner inputs stood, with the same layer working set, so never more than the
  // top. A one-layer top group (L % k == 1) prefetches as it starts.
  const bool deferred_prefetch = st.recompute == Recompute::kEveryK && st.every_k >= 2 &&
                                 L % st.every_k != 1 && !r.prefetches_at_group_top;
  const int64_t top_fetched =
      std::min<int64_t>(C, deferred_prefetch ? 1 : first_kept ? 2 : C >= 3 ? 2 : 1);
  const int64_t ckpt_top = !recompute ? 0 : std::max<int64_t>(on_gpu, st.offload ? top_fetched : 1);
  const int64_t ckpt_bottom = recompute ? 1 : 0;
  // Between the two, the second group from the bottom: its own input on the GPU (and the bottom
  // group's, prefetched or kept, where it is kept) while nearly every gradient already is
  // (measured: hybrid-3b at 1M with the optimizer on the GPU peaked 3.1 GiB above both ends, in a
  // DSA layer of that group, with both inputs there). Only where a group lies between the top
  // and the bottom.
  const int64_t ckpt_middle = recompute && C >= 3 ? (first_kept ? 2 : 1) : 0;
  const int64_t group_layers = st.recompute == Recompute::kEveryK ? st.every_k : 1;
  // Gradients appear as backward produces them: the head's (V x H; with tied embeddings the
  // embedding's too) at the loss, then a layer's at a time. With the optimizer on the host each
  // layer's gradients leave the GPU as they are produced (engine/host_adamw.h ReleaseGrads: sent
  // to the host and dropped at the end of the layer's backward; before 2026-12-05 they stayed to
  // the step, and Llama-3.2-3B at 64K without kept attention outputs peaked 3.7 GB above this
  // plan in layer 1's backward; data-parallel replicas send them after the group's all-reduce).
  // Where the trainer sends nothing early (m.gradients_to_step: RL sessions, context-parallel
  // ranks) they stay, as with the optimizer on the GPU.
  // Sharded, each layer's gradients are reduce-scattered into this rank's shard after its
  // backward: the shard's gradients, the head's and one layer's whole.
  const int64_t head_grad = frozen ? 0 : m.vocab * H * e;
  const bool grads_leave = st.optimizer_on_host && !m.gradients_to_step;
  const int64_t grads_bottom = shards > 1   ? owned * e + head_grad + layer_params * e
                               : grads_leave ? head_grad + layer_params * e
                                             : std::max<int64_t>(head_grad, (trainable - layer_params) * e);
  // The middle phase: the two bottom groups' layers have no gradients yet.
  const int64_t grads_middle =
      shards > 1 || grads_leave ? grads_bottom
                                : std::max<int64_t>(head_grad, (trainable - 2 * group_layers * layer_params) * e);
  const int64_t kept_per_layer = keep ? T * (qd * e + 4 * m.heads) : 0;
  // Without recompute every layer's autograd state stays until backward reaches it: the
  // attention half (layer input, norm output, rotated q and k, v, attention output, residual)
  // and the MLP's (with a tiled MLP only its input, already counted; untiled: gate, up, their
  // product and the norm output).
  int64_t saved_per_layer =
      recompute ? 0
                : T * (e * (3 * H + 2 * qd + 2 * kvd) + 4 * m.heads) +
                      (st.mlp_tile > 0 || m.moe_layers == L ? 0 : T * (3 * I + H) * e);  // MoE saves its input only
  // One layer's recompute and backward (fitted to the peaks measured on one H200, 3B and 1B
  // shapes at 64K-1M): the recomputed activations autograd saves and the gradient buffers,
  // ~7.8 activations of (T, hidden) with one head group; the attention kernel's gradients
  // (dq, dk/dv expanded to the query heads, the fp32 dq accumulator, d(out)) shrink with head
  // groups; without kept outputs the recomputed output and its log-sum-exp are saved too; the
  // MLP's tile (untiled: the whole sequence's intermediates).
  int64_t working = T * e * (39 * H + 39 * qd) / 10 + 6 * T * qd * e / groups;
  if (recompute && !keep) working += T * qd * e / 2 + 4 * T * m.heads;
  int64_t mlp_work = st.mlp_tile > 0 ? 2 * std::min(st.mlp_tile, T) * I * e : 6 * T * I * e;
  // An MoE layer's MLP works one tile at a time (the whole sequence without mlp_tile), forward
  // and recompute alike (model/moe.h): autograd's state of the tile's k x n gathered rows and
  // their SwiGLU intermediates (each expert's run is at most n rows, however uneven the
  // routing), the tile's input, output and their gradients, the router's fp32 logits,
  // probabilities and gradient, and the shared expert's intermediates on every row.
  int64_t moe_work = 0;
  if (m.moe_layers > 0) {
    const int64_t n = st.mlp_tile > 0 ? std::min(st.mlp_tile, T) : T;
    moe_work = n * (m.top_k * (H + 3 * m.moe_intermediate) + 4 * H) * e + n * m.experts * 4 * 3;
    if (m.shared_intermediate > 0) moe_work += n * 3 * m.shared_intermediate * e;
    mlp_work = std::max(m.moe_layers < L ? mlp_work : 0, moe_work);
  }
  working += mlp_work;
  // Without recompute the rest is in saved_per_layer.
  if (!recompute) working = 6 * T * qd * e / groups + (m.moe_layers > 0 ? mlp_work : 3 * T * I * e);
  // Each MoE layer's routing (top-k expert indices, int32) lives from its forward to its
  // backward, so a recompute replays it.
  const int64_t routing_per_layer = m.moe_layers > 0 ? T * m.top_k * 4 : 0;
  // Hybrid layers (fitted to the peaks measured on one H200, hybrid-3b at 64K-256K tokens; the
  // tensors named are those of the CUDA path, model/hybrid.cc, kernels/kda.cc and dsa.cc): one
  // layer's working set is the larger of a KDA and a DSA layer's.
  int64_t hybrid_saved_per_layer = 0;
  Terms hybrid_terms;  // what the hybrid working set is made of (for the message)
  // The dense warm-up's step (below): the larger of a KDA and a DSA layer's forward.
  std::pair<std::string, int64_t> warmup_layer;
  if (m.hybrid) {
    const int64_t HK = m.kda_heads * m.kda_head_dim, Hk = m.kda_heads, K = m.kda_head_dim, C = m.kda_chunk;
    // KDA, sequences longer than a tile run tile by tile (model::kKdaTile) and inside a tile the
    // chunked op a segment at a time (model::kKdaSegment). A layer's backward holds:
    //  - the recomputed tile's autograd state: projections, convs, SiLU, L2 norms, gates, the
    //    output norm and gate (the fused kernels' saved inputs: ~19 bytes a (Tt, HK) element);
    //  - one segment's fp32 intermediates: the chunk quantities recomputed without autograd and
    //    the cache of their factors, the gradients of both (~45 of (Ts, HK)), and the per-chunk
    //    states h with their gradients, 2 x [Ts / C, HV, K, V].
    // Measured for hybrid-3b's 24 heads of 128: 602 KB a segment token (segments of 8192, 16384
    // and 32768 tokens at 64K, 2026-12-04). Refitted on 2026-12-06 (seventeenth session, one
    // H100; the 12-04 peaks had fallen by 6-7 GB since, the fused KDA kernels landing in between,
    // and the plan was 1.40x at 64K): the KDA layer's backward peaks at 64K (C = 64 and 32) and
    // 128K give ~19 bytes a (tile token x HK) element for the tile, ~58 KB a tile token where the
    // 12-04 fit had ~327 KB, and three (T, hidden) that grow with the
    // sequence beyond the checkpointed inputs and the incoming gradient. Fitted, not attributed
    // (the layer's recomputed output, its input's gradient and the mixer's output gradient are
    // candidates). Since the twenty-fifth session (2026-12-07) the CUDA kernels keep h and its
    // gradient in bf16 and the recomputed qg, kg and W too (kernels::SetKdaScanBf16Operands, the
    // default): kda_state below still counts fp32 h, so the plan over-counts a segment by half of
    // it (~0.2 GB at hybrid-3b's 8K segments) until a measured peak refits these terms. Since the
    // twenty-sixth session the backward also keeps its recompute's UT inverse for the intra
    // backward kernel (kernels::SetKdaIntraBackwardReadsInverse): Ts x HV x C fp32, 50 MB at 8K
    // segments, inside that over-count.
    const int64_t Tt = std::min(T, model::kKdaTile), Ts = std::min(Tt, model::kKdaSegment);
    const int64_t kda_stream = 3 * T * m.hidden * e;
    const int64_t kda_tile = Tt * HK * 19;
    const int64_t kda_state = 2 * (Ts / C) * Hk * K * K * 4;
    const int64_t kda_segment = Ts * HK * 180 + kda_state;
    // DSA: the sparse stage runs in query tiles (model::kDsaTile; model/hybrid.h). Its backward
    // holds, per token of the sequence: the gradient of the Function's input (the layer's input,
    // the norm folded in; with r.dsa_keeps_normed_input also the norm's output, kept), the pool selection and the KL's fp32 target, the log-sum-exp, the incoming
    // gradient, k and v and their fp32 gradient accumulators (~34 KB a token for hybrid-3b), the
    // last two of one KV-head group at a time (st.head_groups; DsaAttentionImpl::set_head_groups:
    // 12 KB a token at 1 group, 1.5 KB at 8); per
    // token of one tile, q and dq and the token indices (top_k + 3 int32). Around the mixer, the
    // layer's residual stream while that backward runs: 2.6 of (T, hidden), fitted to the peaks
    // of the backward that runs its tiles from the last with each tile's key side in its own
    // gradient call (2026-12-06, one H100, each peak named by odyssey-bench --phase-times as
    // "dsa sparse attention backward"): hybrid-3b at 512K at full depth in 1 and 8 KV-head groups
    // and cut to 4 layers at 768K in 1 and 8 (2.29-2.54 of (T, hidden) measured). A CPU profile of
    // the same layer (bench/profile_report.py's "alive at the peak") names 2 of them: the gradient
    // the MLP block hands back and the recomputed output rooting the layer's graph. (It was 4.5
    // before that restructure: the old key side's whole-sequence transients.)
    const int64_t W = m.index_top_k + 3, HI = m.index_heads, kp = m.index_top_k / 4;
    const int64_t Tq = std::min(T, model::kDsaTile);
    const int64_t dsa_indices = Tq * (W * 4 + 2 * qd * e);
    const int64_t dsa_stream = 13 * T * m.hidden * e / 5;
    const int64_t dsa_per_token =
        T * ((r.dsa_keeps_normed_input ? 2 : 1) * m.hidden * e + 8 * kp + 4 * m.heads + qd * e +
             2 * kvd * (4 + e) / groups) +
        dsa_indices + dsa_stream;
    const int64_t indexer_scores = std::max<int64_t>(int64_t{256} << 20, 64 * 256 * HI * 4 * 2);
    const int64_t dsa_blocks = indexer_scores;
    // Context parallel (model/hybrid.h): each layer's backward also holds its output gradient in
    // the head layout (this rank's heads of the whole sequence: one rank's positions' worth)
    // beside the incoming one, and one tile's input broadcast by the rank that holds it. By
    // construction; not yet measured on GPUs.
    const bool split = m.context_ranks > 1;
    const int64_t kda_cp = split ? T * HK * e + Tt * m.hidden * e : 0;
    const int64_t dsa_cp = split ? T * qd * e + Tq * m.hidden * e : 0;
    // The dense warm-up (indexer stage dense_warmup; no query tiles, no context parallelism): a
    // DSA layer's backward holds, per token, its input, q, k, v, the attention output and its
    // log-sum-exp, the indexer's q and w, their gradients and the input's, the attention
    // backward's fp32 dq accumulator, and the KL target's copy of the keys, grouped by KV head in
    // their own dtype (kernels::DenseWarmupKl); one KL block's transients (~2.5 x 2 GiB on a
    // GPU: the indexer's dot products, their weighted sum and their gradient,
    // kernels::DenseWarmupKlBlock); the residual stream around the mixer as in the sparse
    // stage. By construction; only reached by a warm-up with a backward through the layers
    // (LoRA, which the trainer refuses with the warm-up).
    const int64_t IQ = HI * m.index_head_dim;
    const int64_t warm_per_token =
        T * (2 * m.hidden * e + 3 * qd * e + 4 * kvd * e + 4 * m.heads + 2 * IQ * e + HI * e + qd * 4 + kvd * e);
    // (On a GPU the target runs as CUDA kernels and a block's transients are the indexer's,
    // ~2.5 of 2 GiB: kernels::DenseWarmupKlBlock.)
    const int64_t warm_blocks = int64_t{3} * (int64_t{2} << 30);
    if (m.warmup_params > 0) {
      // Without grad a KDA layer holds, per token of its tile, q, k, v and the output in the
      // params' dtype, the fp32 gate and the output gate's two 16-bit intermediates; per token of
      // the segment, its fp32 inputs and chunk quantities (~14 of (Ts, HK): q, k, v, g, G, the
      // decay factors, W, U, kg, qg, the output) ; beside them the norm's output, the heads' output
      // and o_proj's, (T, hidden) each. A DSA layer: the norm's output, o_proj's, q and the
      // attention output, k, v and the KL target's view of k, the log-sum-exp, the indexer's q, w
      // and pooled keys with their gradients, and one KL block's transients. By construction.
      const int64_t kda_forward = m.kda_layers > 0 ? Tt * HK * (6 * e + 4) + Ts * HK * 56 + 3 * T * m.hidden * e : 0;
      const int64_t dsa_forward =
          m.dsa_layers == 0 ? 0
                            : T * (2 * m.hidden * e + 2 * qd * e + 3 * kvd * e + 4 * m.heads + 2 * IQ * e + 2 * HI * e) +
                                  (T / 4) * m.index_head_dim * (e + 4) + warm_blocks;
      warmup_layer = kda_forward >= dsa_forward
                         ? std::pair<std::string, int64_t>{"KDA layer forward (one tile's and one segment's tensors)",
                                                           kda_forward}
                         : std::pair<std::string, int64_t>{
                               "DSA layer forward: attention, the indexer and its KL's gradients", dsa_forward};
    }
    const int64_t kda_work = m.kda_layers > 0 ? kda_tile + kda_segment + kda_stream + kda_cp : 0;
    const int64_t dsa_work = m.dsa_layers == 0 ? 0
                             : m.dsa_sparse    ? dsa_per_token + dsa_blocks + dsa_cp
                                               : warm_per_token + warm_blocks + dsa_stream;
    working = std::max(kda_work, dsa_work) + mlp_work;
    if (kda_work >= dsa_work) {
      hybrid_terms = {{"KDA layer: the recomputed tile's autograd state", kda_tile},
                      {"KDA layer: one segment's fp32 chunk intermediates and gradients", kda_segment - kda_state},
                      {"KDA layer: per-chunk states h [T/C, HV, K, V] fp32 and their gradients", kda_state},
                      {"KDA layer: three (T, hidden) around the mixer (fitted)", kda_stream}};
      if (split)
        hybrid_terms.emplace_back("KDA layer, context parallel: the head-layout output gradient, one broadcast tile",
                                  kda_cp);
    } else if (!m.dsa_sparse) {
      hybrid_terms = {{"DSA layer, dense warm-up: attention, indexer, their gradients and the KL's grouped keys",
                       warm_per_token + warm_blocks},
                      {"DSA layer: the residual stream around the mixer (fitted)", dsa_stream}};
    } else {
      hybrid_terms = {{"DSA layer: attention, indexer and their gradients",
                       dsa_per_token - dsa_indices - dsa_stream + dsa_blocks},
                      {"DSA layer: the residual stream around the mixer (fitted)", dsa_stream},
                      {"DSA layer: one query tile's q, dq and token indices (top_k + tail, int32)", dsa_indices}};
      if (split)
        hybrid_terms.emplace_back("DSA layer, context parallel: the head-layout output gradient, one broadcast tile",
                                  dsa_cp);
    }
    // Without recompute every layer keeps its autograd state (a tiled KDA mixer only its input;
    // a DSA layer its tiled Function's input, selection, KL target and log-sum-exp): averaged over
    // the layer kinds.
    const int64_t kda_saved = T > Tt ? T * m.hidden * e : kda_tile;
    // (The warm-up keeps its whole layer: input, q, k, v, output, log-sum-exp, indexer q and w.)
    const int64_t dsa_saved = m.dsa_sparse ? T * (m.hidden * e + 8 * kp + 4 * m.heads)
                                           : T * (m.hidden * e + 2 * qd * e + 2 * kvd * e + 4 * m.heads + IQ * e + HI * e);
    hybrid_saved_per_layer = (m.kda_layers * kda_saved + m.dsa_layers * dsa_saved) / L +
                             (st.mlp_tile > 0 || m.moe_layers == L ? 0 : T * (3 * I + H) * e) + 3 * act;
    if (!recompute)
      working = std::max(kda_segment + (T > Tt ? kda_tile : 0),
                         m.dsa_sparse ? dsa_blocks + dsa_per_token - dsa_stream - dsa_saved
                                      : warm_blocks + warm_per_token - dsa_saved) +
                (st.mlp_tile > 0 || m.moe_layers > 0 ? mlp_work : 3 * T * I * e);
  }
  if (m.hybrid && !recompute) saved_per_layer = hybrid_saved_per_layer;
  if (m.warmup_params > 0) {
    // The dense warm-up step (engine/trainer.cc, model/hybrid.h set_indexer_backward_in_forward):
    // only the indexers train and their input is detached, so the layers run without grad and
    // each DSA layer sends its indexer KL's gradient inside its forward. Nothing is checkpointed
    // or offloaded (recompute and offload have nothing to keep) and no gradient flows through the
    // layers. The GPU holds the parameters, the indexers' gradients and optimizer state, the
    // residual stream around one layer (its input and output), and that layer's forward working
    // set: a KDA layer's tile and segment without autograd state, a DSA layer's the main
    // attention's q, k, v, output and log-sum-exp, the indexer's q, w and pooled keys with the
    // KL's gradients (dq, dw; dk in fp32) and one KL block's transients, or the MLP's tile. By
    // construction; measured at 128K on one H100 (2026-12-05): 1.011x the peak, in a DSA
    // layer's KL.
    // The MLP block: its norm's output and the output buffer, and one tile's intermediates.
    const int64_t mlp_forward = 2 * act + (m.moe_layers > 0  ? moe_work
                                           : st.mlp_tile > 0 ? 3 * std::min(st.mlp_tile, T) * I * e
                                                             : 3 * T * I * e);
    Terms fwd = {{"indexer gradients", m.warmup_params * e}, {"the residual stream around one layer", 2 * act}};
    std::pair<std::string, int64_t> layer = {"one layer's MLP block forward", mlp_forward};
    if (warmup_layer.second > layer.second) layer = warmup_layer;
    fwd.push_back(layer);
    const int64_t loss_forward = st.loss_tile > 0 && st.loss_tile < T ? std::min(st.loss_tile, T) * m.vocab * 10
                                                                      : T * m.vocab * 12;
    const Terms loss = {{"indexer gradients", m.warmup_params * e},
                        {"final hidden state and the final norm's input", 2 * act},
                        {st.loss_tile > 0 && st.loss_tile < T ? "loss tile (logits, softmax)" : "untiled loss (logits, log-softmax)",
                         loss_forward}};
    const Terms step = {{"gradients", m.warmup_params * e}};
    TakePeak(persistent,
             {{"forward (dense warm-up: no backward through the layers)", fwd}, {"loss", loss}, {"optimizer step", step}},
             p);
    p.host_bytes = st.optimizer_on_host ? trainable * (HostStateBytes(st) + e) : 0;
    p.fits = Fits(p, r.hardware);
    return p;
  }
  // Nested checkpoints (every_k): while a group's backward runs, the inputs of its layers after
  // the first stay on the device. The group's recomputed output, the root of the group's graph
  // held through that backward, is a stand-in with one element of storage (engine/memory/
  // checkpoint.h ShapeOnly: its value is never read), so it costs nothing here; the inner
  // layers' own recomputed outputs are counted in the layer's terms.
  const int64_t group_inputs = st.recompute == Recompute::kEveryK ? (st.every_k - 1) * act : 0;
  // The loss: the final hidden state, its gradient and the final norm's input; a tile's bf16
  // logits, their fp32 copy and the softmax (10 bytes per logit), the head gradient's fp32
  // accumulator; untiled, autograd's logits, log-softmax and their gradients (~12 bytes each).
  const int64_t loss_work = st.loss_tile > 0 && st.loss_tile < T
                                ? std::min(st.loss_tile, T) * m.vocab * 10 + (frozen ? 0 : m.vocab * H * 4)
                                : T * m.vocab * 12;

  Terms loss_phase = {{"final hidden state, its gradient, the final norm's input", 3 * act},
                      {st.loss_tile > 0 && st.loss_tile < T ? "loss tile (logits, softmax) and the head's fp32 gradient"
                                                             : "untiled loss (logits, log-softmax, gradients)",
                       loss_work}};
  if (keep) loss_phase.emplace_back("kept attention outputs and log-sum-exp (every layer)", L * kept_per_layer);
  if (!recompute) loss_phase.emplace_back("every layer's saved activations", L * saved_per_layer);
  if (recompute) loss_phase.emplace_back("checkpointed layer inputs on the GPU", on_gpu * act);
  if (routing_per_layer > 0)
    loss_phase.emplace_back("MoE routing records (top-k indices)", m.moe_layers * routing_per_layer);

  enum class Depth { kTop, kMiddle, kBottom };
  auto layer_phase = [&](Depth d) {
    const bool top = d == Depth::kTop;
    // Layers still above (their kept outputs, their saved activations): all at the top, the
    // bottom group's and the one above it in the middle, one at the bottom.
    const int64_t below = top ? L : d == Depth::kMiddle ? std::min<int64_t>(L, 2 * group_layers) : 1;
    Terms t;
    t.emplace_back("checkpointed layer inputs on the GPU (with the prefetched one)",
                   (top ? ckpt_top : d == Depth::kMiddle ? ckpt_middle : ckpt_bottom) * act);
    if (keep) t.emplace_back("kept attention outputs and log-sum-exp", below * kept_per_layer);
    if (!recompute) t.emplace_back("every layer's saved activations", below * saved_per_layer);
    t.emplace_back("gradients so far", top                   ? head_grad + (shards > 1 ? owned * e : 0)
                                       : d == Depth::kMiddle ? grads_middle
                                                             : grads_bottom);
    t.emplace_back("incoming gradient", act);
    if (m.hybrid) {
      // Split so a plan names the hybrid terms.
      int64_t rest = working;
      for (const auto& [name, bytes] : hybrid_terms) {
        const int64_t b = std::min(bytes, rest);
        t.emplace_back(name, b);
        rest -= b;
      }
      t.emplace_back("one layer's MLP, norms and gradients", rest);
    } else {
      t.emplace_back("one layer's activations and gradients", working);
    }
    if (group_inputs > 0) t.emplace_back("inputs of the group being recomputed", group_inputs);
    if (routing_per_layer > 0)
      t.emplace_back("MoE routing records (top-k indices)", (top ? m.moe_layers : 1) * routing_per_layer);
    return t;
  };
  // The step: every gradient (on the host: the last in flight) and, on a CPU rank (libtorch's
  // AdamW ops), fp32 transients of the largest parameter; the fused GPU kernel allocates none.
  const int64_t step_transients = r.hardware.cpu ? m.LargestTrainable() * 4 * 3 : 0;
  Terms step_phase = {{"gradients", st.optimizer_on_host ? m.LargestTrainable() * e : trainable * e}};
  if (step_transients > 0) step_phase.emplace_back("AdamW transients (largest parameter)", step_transients);

  std::vector<std::pair<std::string, Terms>> phases = {{"loss backward", loss_phase},
                                                             {"last layer's backward", layer_phase(Depth::kTop)},
                                                             {"first layer's backward", layer_phase(Depth::kBottom)},
                                                             {"optimizer step", step_phase}};
  if (ckpt_middle > 0) phases.emplace_back("second group's backward", layer_phase(Depth::kMiddle));
  TakePeak(persistent, phases, p);
  // The host optimizer: fp32 master and moments (12 bytes per parameter, pageable; 8 with bf16
  // moments) and the pinned staging its copies go through (one buffer in the params' dtype: the
  // gradient goes down in it, the updated parameter comes back up in it).
  if (st.optimizer_on_host) p.host_bytes += trainable * (HostStateBytes(st) + e);
  // keep_selection: each DSA layer's pool selections (int32, index_top_k / 4 a token), from the
  // first forward to the layer's recompute, in pinned host memory: libtorch's pinned caching
  // allocator, whose blocks are powers of two.
  if (st.keep_selection && recompute && m.dsa_sparse) {
    const auto layer_bytes = static_cast<uint64_t>(T * (m.index_top_k / 4) * 4);
    p.host_bytes += m.dsa_layers * static_cast<int64_t>(std::bit_ceil(layer_bytes));
  }
  p.fits = Fits(p, r.hardware);
  return p;
}

std::string Prediction::Describe() const {
  std::string s = absl::StrCat("GPU peak ", GiB(gpu_peak_bytes), " in the ", peak_phase, ", pinned host ",
                               GiB(host_bytes), " (");
  for (size_t i = 0; i < terms.size(); ++i) absl::StrAppend(&s, i ? "; " : "", terms[i].first, " ", GiB(terms[i].second));
  return s + ")";
}

namespace {

// The candidates in order of speed; the first that fits, else the one that misses by least.
Search SearchStrategies(const ModelShape& model, int64_t seq_len, int64_t batch_size, const Hardware& hw,
                        const ChooseOptions& options) {
  const int64_t T = seq_len * batch_size;
  const Request base = RequestFor(model, seq_len, batch_size, hw, options.param_bytes);
  const MemoryFields& fixed = options.fixed;
  // Tiles: ~1 GiB of MLP intermediates, ~1.5 GiB of fp32 logits per tile.
  const int64_t mlp_tile = std::max<int64_t>(1024, (int64_t{1} << 30) / (model.intermediate * 2 * 6));
  const int64_t loss_tile = std::max<int64_t>(256, (int64_t{3} << 29) / (model.vocab * 4 * 3));
  std::vector<int64_t> group_options;
  for (int64_t g = 1; g <= model.kv_heads; ++g) {
    if (model.kv_heads % g == 0) group_options.push_back(g);
  }
  // The hybrid family groups only the DSA layers' KV heads, in their sparse stage's backward on
  // one rank per sequence (model::ModelConfig::HeadGroupsRefusal); elsewhere in it there is
  // nothing to group.
  if (model.hybrid && !(model.dsa_sparse && model.context_ranks == 1)) group_options = {1};
  if (fixed.head_groups || group_options.empty()) group_options = {fixed.head_groups.value_or(1)};
  Search out;
  Choice& best_miss = out.best;
  int64_t& best_over = out.over;
  auto consider = [&](MemoryStrategy s) -> bool {
    s.mlp_tile = T > mlp_tile ? mlp_tile : 0;
    s.loss_tile = T > loss_tile ? loss_tile : 0;
    s.host_budget_bytes = hw.host_bytes;
    // DSA layers keep their selections for the recompute where the host memory allows (no
    // indexer scoring in the recompute); otherwise they score again.
    std::vector<bool> keep_options = {false};
    if (model.dsa_sparse && s.recompute != Recompute::kNone) keep_options = {true, false};
    for (int64_t g : group_options) {
      for (bool keep_selection : keep_options) {
        s.head_groups = g;
        s.keep_selection = keep_selection;
        Request r = base;
        r.strategy = fixed.ApplyTo(s);
        if (!r.strategy.ValidateForModel(model.layers, model.kv_heads).ok()) continue;
        Prediction p = Predict(r);
        out.any_valid = true;
        if (p.fits) {
          best_miss = {r.strategy, p};
          out.fits = true;
          return true;
        }
        const int64_t over = hw.cpu ? p.gpu_peak_bytes + p.host_bytes - hw.gpu_bytes
                                    : std::max(p.gpu_peak_bytes - hw.gpu_bytes, p.host_bytes - hw.host_bytes);
        if (best_over < 0 || over < best_over) {
          best_over = over;
          best_miss = {r.strategy, p};
        }
      }
    }
    return false;
  };
  auto candidate = [](Recompute recompute, int64_t every_k, bool offload, int64_t device_resident,
                      bool optimizer_on_host, bool bf16_moments = false) {
    MemoryStrategy s;
    s.recompute = recompute;
    s.every_k = every_k;
    s.offload = offload;
    s.device_resident = device_resident;
    s.optimizer_on_host = optimizer_on_host;
    s.bf16_moments = bf16_moments;
    return s;
  };
  // 0. Keeping attention outputs (no attention re-forward), everything else on the GPU.
  // 1. Recompute every layer, everything on the GPU.
  // 2. Offload, keeping as many checkpoints on the GPU as fit (more resident = fewer copies).
  // 3. Nested groups of k layers when the host cannot hold one input per layer.
  // 4. All of that again with the optimizer state on the host (its update runs on CPU threads,
  //    overlapped with backward and the next forward but not wholly hidden; ~4 bytes of PCIe
  //    traffic per parameter per step), for models whose state alone crowds the GPU.
  // 5. And again with its moments in bf16 (a third less host state; a numerics choice, DeepSeek-V3's),
  //    only where the host cannot hold fp32 moments beside the offloaded inputs.
  if (model.warmup_params > 0) {
    // The dense warm-up's step runs its layers without grad (Predict): recompute and offload
    // have nothing to keep, so the plan names neither. The indexers' optimizer state on the
    // device, else on the host.
    for (bool host_optimizer : {false, true}) {
      if (consider(candidate(Recompute::kNone, 2, false, 0, host_optimizer && !hw.cpu))) return out;
    }
    return out;
  }
  if (hw.cpu) {
    // A CPU rank: host memory is its device, so there is nothing to offload to or put the
    // optimizer on. Plain autograd first (CPU memory is plentiful and recompute costs ~1.3x),
    // then recompute every layer, then nested groups.
    if (consider(candidate(Recompute::kNone, 2, false, 0, false))) return out;
    if (consider(candidate(Recompute::kLayer, 2, false, 0, false))) return out;
    for (int64_t k : {int64_t{2}, int64_t{3}, int64_t{4}, int64_t{7}}) {
      if (consider(candidate(Recompute::kEveryK, k, false, 0, false))) return out;
    }
    return out;
  }
  if (options.allow_keep_attention && !model.hybrid) {
    MemoryStrategy keep = candidate(Recompute::kLayer, 2, false, 0, false);
    keep.keep_attention = true;
    if (consider(keep)) return out;
    keep.offload = true;
    if (consider(keep)) return out;
  }
  for (int placement : {0, 1, 2}) {  // the optimizer on the GPU, on the host, on the host with bf16 moments
    const bool host_optimizer = placement > 0, bf16_moments = placement == 2;
    if (consider(candidate(Recompute::kLayer, 2, false, 0, host_optimizer, bf16_moments))) return out;
    for (int64_t k : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{4}, int64_t{7}}) {
      const Recompute mode = k == 1 ? Recompute::kLayer : Recompute::kEveryK;
      const int64_t checkpoints = (model.layers + k - 1) / k;
      for (int64_t resident = checkpoints - 1; resident >= 0; --resident) {
        if (consider(candidate(mode, std::max<int64_t>(k, 2), true, resident, host_optimizer, bf16_moments)))
          return out;
      }
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<Choice> Choose(const ModelShape& model, int64_t seq_len, int64_t batch_size, const Hardware& hw,
                              const ChooseOptions& options) {
  const Search found = SearchStrategies(model, seq_len, batch_size, hw, options);
  if (!found.any_valid) {
    return absl::InvalidArgumentError(absl::StrCat("no strategy is valid with the job's memory fields for this model (",
                                                   options.fixed.ApplyTo({}).Describe(), ")"));
  }
  if (!found.fits) {
    return absl::ResourceExhaustedError(NothingFits(seq_len, batch_size, found, hw));
  }
  return found.best;
}

absl::StatusOr<JobPlan> PlanJob(const JobPlanRequest& q) {
  JobPlan plan;
  if (q.fields.AllSet()) {
    plan.strategy = q.fields.ApplyTo(MemoryStrategy{});
    if (plan.strategy.host_budget_bytes == 0) plan.strategy.host_budget_bytes = q.hardware.host_bytes;
    if (absl::Status s = plan.strategy.ValidateForModel(q.model.layers, q.model.kv_heads); !s.ok()) return s;
  } else {
    ChooseOptions options;
    options.fixed = q.fields;
    options.param_bytes = q.param_bytes;
    options.allow_keep_attention = q.allow_keep_attention;
    const Search found = SearchStrategies(q.model, q.seq_len, q.batch_size, q.hardware, options);
    if (!found.any_valid) {
      // Every candidate was refused by the fields: say why for the one the fields make of none.
      if (absl::Status s = q.fields.ApplyTo(MemoryStrategy{}).ValidateForModel(q.model.layers, q.model.kv_heads);
          !s.ok())
        return s;
      return absl::InvalidArgumentError("memory: no strategy is valid with the job's memory fields for this model");
    }
    if (!found.fits && !q.fields.AnySet()) {  // free to choose, and nothing fits
      plan.found = false;
      plan.message = NothingFits(q.seq_len, q.batch_size, found, q.hardware);
      return plan;
    }
    plan.strategy = found.best.strategy;
  }
  Request r = RequestFor(q.model, q.seq_len, q.batch_size, q.hardware, q.param_bytes);
  r.strategy = plan.strategy;
  plan.prediction = Predict(r);
  plan.fits = plan.prediction.fits;
  if (!plan.fits) plan.message = StrategyMisses(q.seq_len, q.batch_size, plan.strategy, plan.prediction, q.hardware);
  return plan;
}

absl::StatusOr<JobPlan> PlanModelJob(const std::string& model_name, const std::string& dtype, int64_t seq_len,
                                     int64_t batch_size, const MemoryFields& fields, const Hardware& hardware,
                                     const model::LoraConfig& lora, int64_t shard_ranks, int64_t context_ranks,
                                     bool gradients_to_step) {
  absl::StatusOr<model::ModelConfig> config = model::ResolveModelConfig(model_name);
  if (!config.ok()) return absl::InvalidArgumentError(absl::StrCat("spec.model.name: ", config.status().message()));
  return PlanModelJob(*config, dtype, seq_len, batch_size, fields, hardware, lora, shard_ranks, context_ranks,
                      gradients_to_step);
}

absl::StatusOr<JobPlan> PlanModelJob(const model::ModelConfig& config, const std::string& dtype, int64_t seq_len,
                                     int64_t batch_size, const MemoryFields& fields, const Hardware& hardware,
                                     const model::LoraConfig& lora, int64_t shard_ranks, int64_t context_ranks,
                                     bool gradients_to_step) {
  if (absl::Status s = lora.Validate("spec.lora", &config); !s.ok()) return s;
  if (fields.head_groups && config.num_key_value_heads % *fields.head_groups != 0)
    return absl::InvalidArgumentError(absl::StrCat("spec.memory.attention_head_groups: (", *fields.head_groups,
                                                   ") must divide the model's num_key_value_heads (",
                                                   config.num_key_value_heads, ")"));
  if (fields.every_k && fields.recompute == Recompute::kEveryK && *fields.every_k > config.num_hidden_layers)
    return absl::InvalidArgumentError(absl::StrCat("spec.memory.recompute_every_k: (", *fields.every_k,
                                                   ") must be <= the model's num_hidden_layers (",
                                                   config.num_hidden_layers, ")"));
  if (fields.head_groups) {
    if (const std::string no = config.HeadGroupsRefusal(*fields.head_groups, context_ranks); !no.empty())
      return absl::InvalidArgumentError(absl::StrCat("spec.memory.attention_head_groups (", *fields.head_groups, ")", no));
  }
  if (config.IsHybrid()) {
    const char* why = ") is not implemented for the hybrid family: its KDA and DSA layers do not run through the dense "
                      "attention backend";
    if (fields.keep_attention && *fields.keep_attention)
      return absl::InvalidArgumentError(absl::StrCat("spec.memory.keep_attention (true", why));
  }
  if (fields.keep_selection && *fields.keep_selection &&
      !(config.IsHybrid() && config.NumLayersOfKind('D') > 0 && config.hybrid.indexer_stage == model::IndexerStage::kSparse))
    return absl::InvalidArgumentError(
        "spec.memory.keep_selection (true) acts on DSA layers in the sparse indexer stage; the model has none");
  JobPlanRequest q;
  q.model = ShapeOf(config, lora);
  q.model.shard_ranks = std::max<int64_t>(1, shard_ranks);
  q.model.context_ranks = std::max<int64_t>(1, context_ranks);
  q.model.gradients_to_step = gradients_to_step;
  q.seq_len = seq_len;
  q.batch_size = std::max<int64_t>(1, batch_size);
  q.param_bytes = dtype == "float32" ? 4 : 2;
  q.fields = fields;
  q.hardware = hardware;
  absl::StatusOr<JobPlan> plan = PlanJob(q);
  if (!plan.ok()) return absl::InvalidArgumentError(absl::StrCat("spec.", plan.status().message()));
  return plan;
}

bool GradientsToStep(bool rl_session, int64_t context_parallel) {
  return rl_session || context_parallel > 1;
}

Hardware CpuHardware(int64_t host_memory_bytes, int64_t spec_budget_bytes) {
  Hardware h;
  h.gpu_bytes = UsableCpuBytes(host_memory_bytes, spec_budget_bytes);
  h.host_bytes = h.gpu_bytes;  // the same memory (Predict counts both against gpu_bytes)
  h.cpu = true;
  return h;
}

int64_t MaxSeqLen(const ModelShape& model, const Hardware& hw, int64_t granularity, const ChooseOptions& options) {
  int64_t lo = 0, hi = granularity;
  while (Choose(model, hi, 1, hw, options).ok()) {
    lo = hi;
    hi *= 2;
    if (hi > (int64_t{1} << 34)) return lo;
  }
  while (hi - lo > granularity) {
    const int64_t mid = (lo + hi) / 2 / granularity * granularity;
    if (mid <= lo) break;
    if (Choose(model, mid, 1, hw, options).ok()) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

}  // namespace odyssey::planner
