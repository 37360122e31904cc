#include "model/hybrid.h"

#include <cmath>
#include <functional>
#include <limits>

#include <ATen/record_function.h>
#include <torch/torch.h>

#include "kernels/dsa.h"
#include "kernels/fused_ops.h"
#include "kernels/heads.h"
#include "kernels/kda.h"
#include "model/grad_sums.h"
#include "model/layers.h"

namespace odyssey::model {
namespace {

using torch::Tensor;

torch::nn::Linear Lin(int64_t in, int64_t out) { return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false)); }

// Runs `fn` on each document of x (B, S, .) and reassembles (B, S, .) from the results: the
// whole batch at once when no row is packed.
Tensor PerDocument(const Tensor& x, const AttentionMeta& meta, const std::function<Tensor(const Tensor&)>& fn) {
  bool packed = false;
  if (meta.doc_lens != nullptr) {
    for (const auto& row : *meta.doc_lens) packed = packed || row.size() > 1;
  }
  if (!packed) return fn(x);
  TORCH_CHECK(static_cast<int64_t>(meta.doc_lens->size()) == x.size(0), "doc_lens must have one entry per row");
  std::vector<Tensor> rows;
  for (int64_t b = 0; b < x.size(0); ++b) {
    const auto& lens = (*meta.doc_lens)[static_cast<size_t>(b)];
    std::vector<Tensor> parts;
    int64_t start = 0;
    for (int64_t n : lens) {
      parts.push_back(fn(x.narrow(0, b, 1).narrow(1, start, n)));
      start += n;
    }
    TORCH_CHECK(start == x.size(1), "doc_lens of row ", b, " must sum to S (", x.size(1), ")");
    rows.push_back(torch::cat(parts, 1));
  }
  return torch::cat(rows, 0);
}

// Context parallelism runs whole rows (a packed row's documents would need the state and the
// pools to restart at boundaries that fall inside other ranks' shards).
void CheckNotPacked(const AttentionMeta& meta, const char* layer) {
  if (meta.doc_lens == nullptr) return;
  for (const auto& row : *meta.doc_lens)
    TORCH_CHECK(row.size() <= 1, layer, ": packed documents (", row.size(),
                " in a row) are not implemented with context parallelism for the hybrid family");
}

Tensor L2Norm(const Tensor& x) {  // over the last dim, in fp32
  Tensor xf = x.to(torch::kFloat32);
  return (xf * torch::rsqrt(xf.square().sum(-1, /*keepdim=*/true) + 1e-6)).to(x.scalar_type());
}

class AuxLossFunction : public torch::autograd::Function<AuxLossFunction> {
 public:
  static Tensor forward(torch::autograd::AutogradContext* ctx, Tensor out, Tensor aux, double weight) {
    TORCH_CHECK(aux.dim() == 0 && aux.scalar_type() == torch::kFloat32, "InjectAuxLoss: aux must be an fp32 scalar");
    ctx->saved_data["weight"] = weight;
    ctx->saved_data["like"] = torch::empty({0}, aux.options());  // aux's device and dtype
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const double weight = ctx->saved_data["weight"].toDouble();
    return {grads[0], torch::full({}, weight, ctx->saved_data["like"].toTensor().options()), Tensor()};
  }
};

constexpr double kInf = std::numeric_limits<double>::infinity();

}  // namespace

ShortConvImpl::ShortConvImpl(int64_t channels, int64_t kernel) {
  weight = register_parameter("weight", torch::zeros({channels, 1, kernel}));
}

HeadRMSNormImpl::HeadRMSNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", torch::ones({dim}));
}

Tensor HeadRMSNormImpl::forward(const Tensor& x) {
  Tensor xf = x.to(torch::kFloat32);
  return (xf * torch::rsqrt(xf.square().mean(-1, /*keepdim=*/true) + eps_)).to(x.scalar_type()) * weight;
}

KdaAttentionImpl::KdaAttentionImpl(const ModelConfig& c)
    : heads_(c.hybrid.kda_num_heads),
      head_dim_(c.hybrid.kda_head_dim),
      chunk_(c.hybrid.kda_chunk_size),
      conv_kernel_(c.hybrid.kda_conv_kernel),
      lower_bound_(c.hybrid.kda_gate_lower_bound) {
  const int64_t d = c.hidden_size, HK = heads_ * head_dim_, kernel = c.hybrid.kda_conv_kernel;
  q_proj = register_module("q_proj", Lin(d, HK));
  k_proj = register_module("k_proj", Lin(d, HK));
  v_proj = register_module("v_proj", Lin(d, HK));
  q_conv1d = register_module("q_conv1d", ShortConv(HK, kernel));
  k_conv1d = register_module("k_conv1d", ShortConv(HK, kernel));
  v_conv1d = register_module("v_conv1d", ShortConv(HK, kernel));
  f_a_proj = register_module("f_a_proj", Lin(d, head_dim_));
  f_b_proj = register_module("f_b_proj", Lin(head_dim_, HK));
  A_log = register_parameter("A_log", torch::zeros({heads_}));
  dt_bias = register_parameter("dt_bias", torch::zeros({HK}));
  b_proj = register_module("b_proj", Lin(d, heads_));
  g_a_proj = register_module("g_a_proj", Lin(d, head_dim_));
  g_b_proj = register_module("g_b_proj", Lin(head_dim_, HK));
  o_norm = register_module("o_norm", HeadRMSNorm(head_dim_, c.rms_norm_eps));
  o_proj = register_module("o_proj", Lin(HK, d));
}

void KdaAttentionImpl::InitSpecial(const std::optional<at::Generator>& gen) {
  torch::NoGradGuard no_grad;
  // Conv1d's default: uniform within 1 / sqrt(fan_in), fan_in = the kernel (depthwise).
  for (ShortConv* conv : {&q_conv1d, &k_conv1d, &v_conv1d}) {
    const double bound = 1.0 / std::sqrt(static_cast<double>((*conv)->weight.size(2)));
    (*conv)->weight.uniform_(-bound, bound, gen);
  }
  // Spec 1.1: A_log = log U(1, 16); dt_bias = softplus^-1(dt), dt log-uniform in [1e-3, 0.1].
  Tensor a = torch::empty({heads_}, A_log.options().dtype(torch::kFloat32)).uniform_(1.0, 16.0, gen);
  Tensor dt = torch::exp(torch::empty({heads_ * head_dim_}, dt_bias.options().dtype(torch::kFloat32))
                             .uniform_(std::log(1e-3), std::log(0.1), gen));
  A_log.copy_(a.log());
  dt_bias.copy_(dt + torch::log(-torch::expm1(-dt)));
}

void KdaAttentionImpl::RestoreFp32(const Tensor& a_log, const Tensor& dt) {
  A_log.set_data(a_log.to(A_log.device(), torch::kFloat32));
  dt_bias.set_data(dt.to(dt_bias.device(), torch::kFloat32));
}

void KdaAttentionImpl::to(torch::Dtype dtype, bool non_blocking) {
  const Tensor a = A_log.detach().clone(), dt = dt_bias.detach().clone();
  torch::nn::Module::to(dtype, non_blocking);
  RestoreFp32(a, dt);
}

void KdaAttentionImpl::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  const Tensor a = A_log.detach().clone(), dt = dt_bias.detach().clone();
  torch::nn::Module::to(device, dtype, non_blocking);
  RestoreFp32(a, dt);
}

void KdaAttentionImpl::to(torch::Device device, bool non_blocking) {
  torch::nn::Module::to(device, non_blocking);
}

Tensor KdaAttentionImpl::TileHeads(const Tensor& x_ctx, int64_t ctx, const Tensor& h0, Tensor* h_out,
                                   int64_t first_head, int64_t num_heads) {
  const int64_t B = x_ctx.size(0), n = x_ctx.size(1) - ctx, H = num_heads < 0 ? heads_ : num_heads, K = head_dim_;
  TORCH_CHECK(first_head >= 0 && H > 0 && first_head + H <= heads_, "KDA: heads [", first_head, ", ",
              first_head + H, ") out of the layer's ", heads_);
  const int64_t r0 = first_head * K, rows = H * K;  // the heads' rows of the per-head weights
  auto heads = [&](const Tensor& t) { return t.reshape({B, n, H, K}); };  // (B, n, H, K)
  // The convolutions see the context; everything after them only the tile's tokens.
  // silu(conv(proj(x))) of the n rows after the context (kernels::ShortConvSilu: libtorch's
  // depthwise conv1d on the CPU, one fused kernel on the GPU).
  // (The heads' rows of a projection: model/lora_adapter.h's ProjectRows, with its adapter.)
  auto conv_silu = [&](ShortConv& c, torch::nn::Linear& proj, const LoraAdapter& lora) {
    return kernels::ShortConvSilu(ProjectRows(proj, lora, x_ctx, r0, rows), c->weight.narrow(0, r0, rows), ctx);
  };
  const Tensor x = x_ctx.narrow(1, ctx, n);
  Tensor q = L2Norm(heads(conv_silu(q_conv1d, q_proj, q_lora))).transpose(1, 2);  // (B, H, n, K)
  Tensor k = L2Norm(heads(conv_silu(k_conv1d, k_proj, k_lora))).transpose(1, 2);  // (B, H, n, K)
  Tensor v = heads(conv_silu(v_conv1d, v_proj, v_lora)).transpose(1, 2);          // (B, H, n, K)
  // The safe gate in fp32: lb * sigmoid(exp(A_log[h]) (f + dt_bias)) in (lb, 0).
  Tensor f = ProjectRows(f_b_proj, LoraAdapter{}, f_a_proj(x), r0, rows).to(torch::kFloat32) + dt_bias.narrow(0, r0, rows);  // (B, n, H K)
  Tensor g = lower_bound_ * torch::sigmoid(heads(f) * A_log.narrow(0, first_head, H).exp().view({H, 1}));  // (B, n, H, K)
  g = g.transpose(1, 2);                                                                        // (B, H, n, K)
  Tensor beta = torch::sigmoid(ProjectRows(b_proj, LoraAdapter{}, x, first_head, H).to(torch::kFloat32)).transpose(1, 2);  // (B, H, n)
  kernels::KdaOptions options;
  options.chunk_size = chunk_;
  options.segment = segment_;
  auto [o, state] = kernels::KdaChunked(q, k, v, g, beta, h0, options);  // (B, H, n, K), (B, H, K, K)
  if (h_out != nullptr) *h_out = state;
  Tensor gate = torch::sigmoid(heads(ProjectRows(g_b_proj, LoraAdapter{}, g_a_proj(x), r0, rows)));  // (B, n, H, K)
  return (o_norm(o.transpose(1, 2)) * gate).reshape({B, n, H * K});
}

namespace {

struct KdaTileState : torch::CustomClassHolder {
  KdaAttentionImpl* mixer = nullptr;
  int64_t tile = 0;
};

// The mixer's parameters that train (what its tiles' backward differentiates).
std::vector<Tensor> TrainedWeights(KdaAttentionImpl& m) {
  std::vector<Tensor> weights;
  for (const auto& p : m.parameters()) {
    if (p.requires_grad()) weights.push_back(p);
  }
  return weights;
}

// One tile's backward through KdaAttentionImpl::TileHeads over heads [first, first + heads) (-1:
// all): rows x_ctx (B, ctx + n, hidden), the first ctx only the convolution's context; h0 the
// state entering the tile (undefined: zero); gy (B, n, heads K) its output's gradient and dh the
// gradient of the state it hands on (undefined: none). Adds the weight gradients to `sums`;
// returns x_ctx's gradient (zeros where none reached it) and sets *dh0 to h0's.
Tensor KdaTileBackward(KdaAttentionImpl& m, const Tensor& x_ctx, int64_t ctx, const Tensor& h0_in, const Tensor& gy,
                       const Tensor& dh, int64_t first, int64_t heads, Fp32GradSums& sums, Tensor* dh0) {
  const Tensor xt = x_ctx.detach().requires_grad_(true);
  const Tensor h0 = h0_in.defined() ? h0_in.detach().requires_grad_(true) : Tensor();
  Tensor y, h_next;
  {
    torch::AutoGradMode grad(true);
    y = m.TileHeads(xt, ctx, h0, &h_next, first, heads);
  }
  std::vector<Tensor> outputs = {y}, grad_outputs = {gy};
  if (dh.defined()) {
    outputs.push_back(h_next);
    grad_outputs.push_back(dh);
  }
  std::vector<Tensor> inputs = {xt};
  if (h0.defined()) inputs.push_back(h0);
  inputs.insert(inputs.end(), sums.weights().begin(), sums.weights().end());
  std::vector<Tensor> d = torch::autograd::grad(outputs, inputs, grad_outputs, /*retain_graph=*/false,
                                                /*create_graph=*/false, /*allow_unused=*/true);
  size_t next = 1;
  *dh0 = h0.defined() ? d[next++] : Tensor();
  sums.Add(std::vector<Tensor>(d.begin() + static_cast<std::ptrdiff_t>(next), d.end()));
  return d[0].defined() ? d[0] : torch::zeros_like(xt);
}

// x (B, S, hidden) -> (B, S, H K) tile by tile (see KdaAttentionImpl::Heads). Saved: x and the
// state entering each tile after the first (B, H, K, K) fp32.
class KdaTiledFunction : public torch::autograd::Function<KdaTiledFunction> {
 public:
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, c10::intrusive_ptr<KdaTileState> st) {
    torch::NoGradGuard no_grad;
    std::vector<Tensor> states;
    Tensor out = Run(*st->mixer, x, st->tile, &states);
    states.insert(states.begin(), x);
    ctx->save_for_backward(states);
    ctx->saved_data["state"] = c10::IValue::make_capsule(st);
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto st = c10::static_intrusive_pointer_cast<KdaTileState>(ctx->saved_data["state"].toCapsule());
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const Tensor& x = saved[0];
    const Tensor& gy = grads[0];  // (B, S, H K)
    KdaAttentionImpl& m = *st->mixer;
    const int64_t S = x.size(1), c = m.conv_context();
    Fp32GradSums sums(TrainedWeights(m));
    Tensor dx = torch::zeros_like(x);
    Tensor dh;  // gradient of the state the current tile hands on (undefined: none)
    const int64_t tiles = (S + st->tile - 1) / st->tile;
    for (int64_t i = tiles - 1; i >= 0; --i) {
      const int64_t t0 = i * st->tile, n = std::min(st->tile, S - t0), ctx_n = std::min(c, t0);
      const Tensor h0 = i == 0 ? Tensor() : saved[static_cast<size_t>(i)];
      dx.narrow(1, t0 - ctx_n, ctx_n + n)
          .add_(KdaTileBackward(m, x.narrow(1, t0 - ctx_n, ctx_n + n), ctx_n, h0, gy.narrow(1, t0, n), dh, 0, -1,
                                sums, &dh));
    }
    sums.WriteGrads();
    return {dx, Tensor()};
  }

  // The tiles without a graph; *states gets the state entering each tile after the first. Each
  // tile's output goes into its slice of the result as it is made: never the whole sequence's
  // output twice (the tiles and their concatenation).
  static Tensor Run(KdaAttentionImpl& m, const Tensor& x, int64_t tile, std::vector<Tensor>* states) {
    const int64_t S = x.size(1), c = m.conv_context();
    Tensor out, h;
    for (int64_t t0 = 0; t0 < S; t0 += tile) {
      const int64_t n = std::min(tile, S - t0), ctx_n = std::min(c, t0);
      if (t0 > 0 && states != nullptr) states->push_back(h);
      Tensor next;
      const Tensor part = m.TileHeads(x.narrow(1, t0 - ctx_n, ctx_n + n), ctx_n, h, &next);
      if (t0 == 0 && n == S) return part;  // one tile: the result itself
      if (!out.defined()) out = torch::empty({part.size(0), S, part.size(2)}, part.options());
      out.narrow(1, t0, n).copy_(part);
      h = next;
    }
    return out;
  }
};

// The tiles of a sequence sharded over a group (rank j holds positions [j L, (j+1) L)), in
// sequence order: tiles of at most `tile` tokens (0: the whole shard) inside each shard.
struct ShardTile {
  int owner = 0;      // the rank that holds it
  int64_t local = 0;  // its first position in the owner's shard
  int64_t start = 0;  // its first position in the sequence
  int64_t n = 0;      // tokens
};

std::vector<ShardTile> ShardTiles(int P, int64_t L, int64_t tile) {
  std::vector<ShardTile> out;
  const int64_t step = tile > 0 ? std::min(tile, L) : L;
  for (int j = 0; j < P; ++j) {
    for (int64_t t = 0; t < L; t += step) out.push_back({j, t, j * L + t, std::min(step, L - t)});
  }
  return out;
}

// The `ctx` rows before this rank's shard x (B, L, hidden): the previous rank's last ones, from
// an all-gather of every rank's last ctx rows. Undefined on rank 0 and for ctx 0.
Tensor Halo(const SequenceGroup& group, const Tensor& x, int64_t ctx) {
  if (ctx == 0) return Tensor();
  TORCH_CHECK(x.size(1) >= ctx, "context parallel: a rank's ", x.size(1), " positions are fewer than the ", ctx,
              " tokens of context the short convolution reads");
  Tensor all = group.AllGather(x.narrow(1, x.size(1) - ctx, ctx).contiguous(), 1);  // (B, P ctx, hidden)
  if (group.rank() == 0) return Tensor();
  return all.narrow(1, (group.rank() - 1) * ctx, ctx);
}

// Rows [tile.start - ctx, tile.start + tile.n) of the sequence, from the rank that holds the
// tile to every rank: its shard x and `halo` (Halo) there, a fresh buffer elsewhere.
Tensor BroadcastRows(const SequenceGroup& group, const Tensor& x, const Tensor& halo, const ShardTile& tile,
                     int64_t ctx) {
  Tensor rows;
  if (group.rank() == tile.owner) {
    if (tile.local >= ctx) {
      rows = x.narrow(1, tile.local - ctx, ctx + tile.n).detach();  // the root's rows are only read
    } else {
      const int64_t before = ctx - tile.local;
      rows = torch::cat({halo.narrow(1, halo.size(1) - before, before), x.narrow(1, 0, tile.local + tile.n)}, 1);
    }
  } else {
    rows = torch::empty({x.size(0), ctx + tile.n, x.size(2)}, x.options());
  }
  group.Broadcast(rows, tile.owner);
  return rows;
}

// Adds a tile's input gradient d (rows [tile.start - ctx, tile.start + n)), summed over the
// ranks, where the rank that holds the tile keeps it: its shard's rows into dx, the rows before
// the shard into dhalo (the last rows of dhalo's ctx).
void AddTileGradient(const SequenceGroup& group, Tensor d, const ShardTile& tile, int64_t ctx, Tensor& dx,
                     Tensor& dhalo) {
  group.AllReduceSum(d);
  if (group.rank() != tile.owner) return;
  const int64_t first = tile.local - ctx;  // in the shard; negative: rows of the halo
  if (first >= 0) {
    dx.narrow(1, first, ctx + tile.n).add_(d);
    return;
  }
  dhalo.narrow(1, dhalo.size(1) + first, -first).add_(d.narrow(1, 0, -first));
  dx.narrow(1, 0, ctx + tile.n + first).add_(d.narrow(1, -first, ctx + tile.n + first));
}

// The halo's gradient (Halo) back to the rank whose rows they are, added to dx's last rows.
void ReturnHaloGradient(const SequenceGroup& group, const Tensor& dhalo, Tensor& dx) {
  const int64_t ctx = dhalo.size(1);
  if (ctx == 0) return;
  Tensor all = group.AllGather(dhalo.contiguous(), 1);  // (B, P ctx, hidden): rank 0's is zeros
  if (group.rank() + 1 < group.size())
    dx.narrow(1, dx.size(1) - ctx, ctx).add_(all.narrow(1, (group.rank() + 1) * ctx, ctx));
}

struct KdaShardState : torch::CustomClassHolder {
  KdaAttentionImpl* mixer = nullptr;
  const SequenceGroup* group = nullptr;
  int64_t tile = 0;  // tokens per tile (0: one per shard)
};

// x (B, L, hidden), this rank's shard, -> (B, L, H K) over the group (KdaAttentionImpl::Heads).
// Saved: x and this rank's heads' state entering each tile of the sequence after the first.
class KdaShardedFunction : public torch::autograd::Function<KdaShardedFunction> {
 public:
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, c10::intrusive_ptr<KdaShardState> st) {
    torch::NoGradGuard no_grad;
    std::vector<Tensor> states;
    Tensor out = Run(*st, x, &states);
    states.insert(states.begin(), x);
    ctx->save_for_backward(states);
    ctx->saved_data["state"] = c10::IValue::make_capsule(st);
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto st = c10::static_intrusive_pointer_cast<KdaShardState>(ctx->saved_data["state"].toCapsule());
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const Tensor& x = saved[0];
    const SequenceGroup& group = *st->group;
    KdaAttentionImpl& m = *st->mixer;
    const int P = group.size();
    const int64_t L = x.size(1), c = m.conv_context(), heads = m.num_heads() / P, first = group.rank() * heads;
    // This rank's heads of the whole sequence's output gradient: (B, S, heads K).
    const Tensor gy = group.AllToAll(grads[0].contiguous(), 2, 1);
    grads.clear();
    Fp32GradSums sums(TrainedWeights(m));
    Tensor dx = torch::zeros_like(x);
    Tensor dhalo = torch::zeros({x.size(0), c, x.size(2)}, x.options());
    const Tensor halo = Halo(group, x, c);
    const std::vector<ShardTile> tiles = ShardTiles(P, L, st->tile);
    Tensor dh;  // gradient of the state the current tile hands on (undefined: none)
    for (size_t i = tiles.size(); i-- > 0;) {
      const ShardTile& t = tiles[i];
      const int64_t ctx_n = std::min(c, t.start);
      const Tensor h0 = i == 0 ? Tensor() : saved[i];
      const Tensor dxt = KdaTileBackward(m, BroadcastRows(group, x, halo, t, ctx_n), ctx_n, h0,
                                         gy.narrow(1, t.start, t.n), dh, first, heads, sums, &dh);
      AddTileGradient(group, dxt, t, ctx_n, dx, dhalo);
    }
    ReturnHaloGradient(group, dhalo, dx);
    sums.WriteGrads();
    return {dx, Tensor()};
  }

  // The tiles without a graph; *states (optional) gets the state entering each tile after the first.
  static Tensor Run(const KdaShardState& st, const Tensor& x, std::vector<Tensor>* states) {
    const SequenceGroup& group = *st.group;
    KdaAttentionImpl& m = *st.mixer;
    const int P = group.size();
    const int64_t B = x.size(0), L = x.size(1), c = m.conv_context(), heads = m.num_heads() / P;
    const Tensor halo = Halo(group, x, c);
    Tensor out;  // (B, S, heads K): this rank's heads of the whole sequence
    Tensor h;
    for (const ShardTile& t : ShardTiles(P, L, st.tile)) {
      const int64_t ctx_n = std::min(c, t.start);
      if (t.start > 0 && states != nullptr) states->push_back(h);
      Tensor next;
      Tensor y = m.TileHeads(BroadcastRows(group, x, halo, t, ctx_n), ctx_n, h, &next, group.rank() * heads, heads);
      if (!out.defined()) out = torch::empty({B, P * L, y.size(2)}, y.options());
      out.narrow(1, t.start, t.n).copy_(y);
      h = next;
    }
    return group.AllToAll(out, 1, 2);  // (B, L, H K)
  }
};

}  // namespace

Tensor KdaAttentionImpl::HeadsOfDocument(const Tensor& x) {
  if (tile_ <= 0 || x.size(1) <= tile_) return TileHeads(x, 0, Tensor(), nullptr);
  if (!torch::GradMode::is_enabled()) return KdaTiledFunction::Run(*this, x, tile_, nullptr);
  auto st = c10::make_intrusive<KdaTileState>();
  st->mixer = this;
  st->tile = tile_;
  // The Function records a backward node only for inputs that need grad; the mixer's
  // parameters need it even when x does not.
  return KdaTiledFunction::apply(x.requires_grad() ? x : x.detach().requires_grad_(true), st);
}

void KdaAttentionImpl::set_segment(int64_t tokens) {
  TORCH_CHECK(tokens > 0 && tokens % chunk_ == 0, "KDA segment (", tokens,
              ") must be a positive multiple of the chunk size (", chunk_, ")");
  segment_ = tokens;
}

Tensor KdaAttentionImpl::Heads(const Tensor& x, const AttentionMeta& meta, const SequenceGroup* group) {
  if (group == nullptr || group->size() == 1)
    return PerDocument(x, meta, [this](const Tensor& xd) { return HeadsOfDocument(xd); });
  CheckNotPacked(meta, "KDA");
  TORCH_CHECK(heads_ % group->size() == 0, "KDA: context_parallel (", group->size(), ") must divide the layer's ",
              heads_, " heads");
  auto st = c10::make_intrusive<KdaShardState>();
  st->mixer = this;
  st->group = group;
  st->tile = tile_;
  if (!torch::GradMode::is_enabled()) return KdaShardedFunction::Run(*st, x, nullptr);
  return KdaShardedFunction::apply(x.requires_grad() ? x : x.detach().requires_grad_(true), st);
}

DsaIndexerImpl::DsaIndexerImpl(const ModelConfig& c)
    : heads_(c.hybrid.index_num_heads), head_dim_(c.hybrid.index_head_dim) {
  const int64_t d = c.hidden_size;
  wq = register_module("wq", Lin(d, heads_ * head_dim_));
  wk = register_module("wk", Lin(d, head_dim_));
  k_norm = register_module("k_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({head_dim_})));
  weights_proj = register_module("weights_proj", Lin(d, heads_));
  pool_gate = register_module("pool_gate", Lin(d, head_dim_));
  pool_bias = register_parameter("pool_bias", torch::zeros({4, head_dim_}));
}

DsaIndexerImpl::Out DsaIndexerImpl::forward(const Tensor& x) {
  Out o;
  Queries(x, &o.q, &o.w);
  o.keys = Keys(x);
  return o;
}

void DsaIndexerImpl::Queries(const Tensor& x, Tensor* q, Tensor* w) {
  const int64_t B = x.size(0), S = x.size(1);
  *q = wq(x).view({B, S, heads_, head_dim_}).transpose(1, 2);     // (B, HI, S, DI)
  *w = weights_proj(x) / std::sqrt(static_cast<double>(heads_));  // (B, S, HI)
}

Tensor DsaIndexerImpl::Keys(const Tensor& x) {
  return kernels::KeyPool4(k_norm(wk(x)), pool_gate(x), pool_bias);  // (B, S / 4, DI)
}

DsaAttentionImpl::DsaAttentionImpl(const ModelConfig& c)
    : heads_(c.num_attention_heads),
      kv_heads_(c.num_key_value_heads),
      head_dim_(c.HeadDim()),
      top_pools_(c.hybrid.index_top_k / 4),
      stage_(c.hybrid.indexer_stage),
      loss_weight_(c.hybrid.indexer_loss_weight) {
  const int64_t d = c.hidden_size;
  q_proj = register_module("q_proj", Lin(d, heads_ * head_dim_));
  k_proj = register_module("k_proj", Lin(d, kv_heads_ * head_dim_));
  v_proj = register_module("v_proj", Lin(d, kv_heads_ * head_dim_));
  o_proj = register_module("o_proj", Lin(heads_ * head_dim_, d));
  indexer = register_module("indexer", DsaIndexer(c));
}

void DsaAttentionImpl::InitSpecial(const std::optional<at::Generator>& /*gen*/) {
  torch::NoGradGuard no_grad;
  indexer->k_norm->weight.fill_(1.0);
  indexer->k_norm->bias.zero_();
  indexer->pool_bias.zero_();
}

Tensor DsaAttentionImpl::SplitHeads(const torch::nn::Linear& proj, const LoraAdapter& lora, const Tensor& x) {
  return Project(proj, lora, x).view({x.size(0), x.size(1), -1, head_dim_}).transpose(1, 2);
}

void DsaAttentionImpl::set_tile(int64_t tokens) {
  TORCH_CHECK(tokens > 0, "DSA tile (", tokens, ") must be a positive number of queries");
  tile_ = tokens;
}

void DsaAttentionImpl::set_head_groups(int64_t groups) {
  TORCH_CHECK(groups >= 1 && kv_heads_ % groups == 0, "DSA head_groups (", groups,
              ") must be a positive divisor of the layer's KV heads (", kv_heads_, ")");
  head_groups_ = groups;
}

void DsaAttentionImpl::set_selection_mode(SelectionMode mode) {
  if (mode == SelectionMode::kRecord) kept_.clear();  // a new first forward replaces what was kept
  replay_cursor_ = 0;
  selection_mode_ = mode;
}

int64_t DsaAttentionImpl::kept_selection_bytes() const {
  int64_t bytes = 0;
  for (const Tensor& t : kept_) {
    if (t.defined()) bytes += t.numel() * static_cast<int64_t>(t.element_size());
  }
  return bytes;
}

namespace {

// The sparse KL's target for queries q (B, H, n, D) with token indices idx (B, n, W), pool
// selection pool_idx (B, n, kp) and the attention's log-sum-exp lse (B, H, n) from the same
// rows' forward: the main attention's probabilities (no grad), head-mean, summed
// within each selected pool and L1-normalised over them; (B, n, kp) fp32. Chunk by chunk: ~256
// MiB of (rows, W) probabilities at a time.
//
// With a group of P ranks (context parallelism) q holds this rank's H/P heads: each rank's
// head-mean over its heads, divided by P, is summed over the ranks (an all-reduce per chunk, every
// rank calling it alike) before the normalisation, so every rank gets the target of all heads.
Tensor KlTarget(const Tensor& q, const Tensor& k, const Tensor& idx, const Tensor& pool_idx, const Tensor& lse,
                const SequenceGroup* group = nullptr) {
  torch::NoGradGuard no_grad;
  const int64_t B = q.size(0), n = q.size(2), kp = pool_idx.size(2), W = idx.size(2);
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  const int64_t rows = std::max<int64_t>(64, (int64_t{256} << 20) / std::max<int64_t>(1, B * W * 4));
  Tensor target;
  for (int64_t t0 = 0; t0 < n; t0 += rows) {
    const int64_t m = std::min(rows, n - t0);
    Tensor p = kernels::SparseAttentionProbs(q.narrow(2, t0, m), k, idx.narrow(1, t0, m), scale, 64,
                                             lse.narrow(2, t0, m));  // (B, m, W)
    Tensor valid = pool_idx.narrow(1, t0, m) >= 0;                                                 // (B, m, kp)
    Tensor tg = p.narrow(2, 0, 4 * kp).reshape({B, m, kp, 4}).sum(-1).masked_fill(valid.logical_not(), 0.0);
    if (group != nullptr && group->size() > 1) {
      tg = (tg / static_cast<double>(group->size())).contiguous();
      group->AllReduceSum(tg);
    }
    tg = tg / tg.sum(-1, /*keepdim=*/true).clamp_min(1e-30);
    if (!target.defined()) target = torch::empty({B, n, kp}, tg.options());
    target.narrow(1, t0, m).copy_(tg);
  }
  return target;
}

// A pass's kept selection (DsaAttentionImpl::set_selection_mode): at most one is defined.
struct DsaSelectionIo {
  Tensor replay;  // (B, S, kp) int32, host or device: the selection to use
  Tensor record;  // (B, S, kp) int32: where to keep this pass's selection
};

// Heads [first, first + count) of head_dim of proj(x), x (B, n, in): (B, count, n, head_dim),
// through those heads' rows of the weight.
Tensor HeadRows(const torch::nn::Linear& proj, const LoraAdapter& lora, const Tensor& x, int64_t first, int64_t count,
               int64_t head_dim) {
  return ProjectRows(proj, lora, x, first * head_dim, count * head_dim)
      .view({x.size(0), x.size(1), count, head_dim})
      .transpose(1, 2);
}

struct DsaTileState : torch::CustomClassHolder {
  DsaAttentionImpl* mixer = nullptr;
  RMSNormImpl* norm = nullptr;           // TiledFunction's input is the norm's (Heads' input_norm)
  const SequenceGroup* group = nullptr;  // ShardedFunction's ranks
  DsaSelectionIo selection;
  bool kl = false;   // compute the indexer KL (the second output)
  int64_t rows = 0;  // set by forward: query rows with at least one pool
};

}  // namespace

// x (B, S, hidden) -> (B, S, H D) and the KL summed over rows (fp32 0-d; 0 without kl). Saved:
// x, the pool selection (B, S, kp) int32, the log-sum-exp (B, H, S) fp32 and, with kl, the KL's
// target (B, S, kp) fp32.
class DsaAttentionImpl::TiledFunction : public torch::autograd::Function<TiledFunction> {
 public:
  struct Saved {
    Tensor pool_idx, lse, target, kl;
    int64_t rows = 0;
  };

  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& x,
                                                c10::intrusive_ptr<DsaTileState> st) {
    torch::NoGradGuard no_grad;
    Saved saved;
    // With the norm folded in, its output lives only while the tiles run.
    Tensor out = Run(*st->mixer, st->norm != nullptr ? st->norm->forward(x) : x, st->kl, &saved, st->selection);
    return Keep(ctx, st, x, saved, std::move(out));
  }

  // Rows [t0, t0 + n) of the layer's normalized input without a graph: x's own, or with the norm
  // folded in (st.norm), the norm of x's rows.
  static Tensor NormedRows(const DsaTileState& st, const Tensor& x, int64_t t0, int64_t n) {
    const Tensor rows = x.narrow(1, t0, n);
    if (st.norm == nullptr) return rows;
    torch::NoGradGuard no_grad;
    return st.norm->forward(rows);
  }

  // Chunks of whole pools (a multiple of 4 tokens, pools counting from the sequence's first
  // token) covering [0, S): the folded norm's pooled keys are built and differentiated by them.
  static int64_t KeyChunk(const DsaAttentionImpl& m) { return std::max<int64_t>(4, m.tile_ / 4 * 4); }

  // What forward keeps for backward of a pass's result (ShardedFunction's too): x, the selection,
  // the log-sum-exp and the KL target; returns the output and the KL.
  static torch::autograd::variable_list Keep(torch::autograd::AutogradContext* ctx,
                                             const c10::intrusive_ptr<DsaTileState>& st, const Tensor& x,
                                             const Saved& saved, Tensor out) {
    st->rows = saved.rows;
    ctx->save_for_backward({x, saved.pool_idx, saved.lse, saved.target});
    ctx->saved_data["state"] = c10::IValue::make_capsule(st);
    ctx->set_materialize_grads(false);
    if (!st->kl) ctx->mark_non_differentiable({saved.kl});
    return {std::move(out), saved.kl};
  }

  // A tile's q, k and v with a graph back to xt (B, n, hidden) and the weights: query heads
  // [q0, q0 + hq) and KV heads [k0, k0 + hk), each (B, heads, n, head_dim).
  static std::tuple<Tensor, Tensor, Tensor> TileProjections(DsaAttentionImpl& m, const Tensor& xt, int64_t q0,
                                                            int64_t hq, int64_t k0, int64_t hk) {
    torch::AutoGradMode grad(true);
    return {HeadRows(m.q_proj, m.q_lora, xt, q0, hq, m.head_dim_), HeadRows(m.k_proj, m.k_lora, xt, k0, hk, m.head_dim_),
            HeadRows(m.v_proj, m.v_lora, xt, k0, hk, m.head_dim_)};
  }

  // The layer's parameters that train: q, k and v's (which learn only from the output), then the
  // indexer's (only from the KL).
  static std::vector<Tensor> TrainedWeights(DsaAttentionImpl& m) {
    std::vector<Tensor> weights;
    for (const auto& mod : {m.q_proj.ptr(), m.k_proj.ptr(), m.v_proj.ptr()}) {
      for (const auto& p : mod->parameters()) {
        if (p.requires_grad()) weights.push_back(p);
      }
    }
    for (const auto& p : m.indexer->parameters()) {
      if (p.requires_grad()) weights.push_back(p);
    }
    return weights;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto st = c10::static_intrusive_pointer_cast<DsaTileState>(ctx->saved_data["state"].toCapsule());
    const torch::autograd::variable_list sv = ctx->get_saved_variables();
    const Tensor &x = sv[0], &pool_all = sv[1], &lse_all = sv[2], &target_all = sv[3];
    DsaAttentionImpl& m = *st->mixer;
    const int64_t B = x.size(0), S = x.size(1), H = m.heads_, Hkv = m.kv_heads_, D = m.head_dim_;
    const bool out_grad = grads[0].defined(), kl_grad = st->kl && grads.size() > 1 && grads[1].defined();
    if (!out_grad && !kl_grad) return {Tensor(), Tensor()};
    const bool folded = st->norm != nullptr;  // x is the norm's input; dx its gradient
    std::vector<Tensor> weights = TrainedWeights(m);
    if (folded && st->norm->weight.requires_grad()) weights.push_back(st->norm->weight);
    Fp32GradSums sums(weights);
    Tensor dx = torch::zeros_like(x);
    const auto acc = torch::TensorOptions().dtype(x.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32)
                         .device(x.device());
    // The KV heads in head_groups() groups, one after another: group g's query heads
    // [g hq, (g + 1) hq) read its KV heads [g hk, (g + 1) hk) (GQA's order). Per group, its heads'
    // keys and values of the whole sequence without a graph and their fp32 gradient accumulators;
    // then the tiles from the last: once a tile's queries are done no query left sees its keys
    // (causal), so their gradient is final and goes back through the tile's own k and v
    // projections in the same gradient call as its q's. Nothing (T, hidden) wide is made here
    // but dx. The indexer's KL (no heads) runs with the first group; its pooled keys (pools count
    // from the sequence's first token, across tiles) go back once for the whole sequence.
    const int64_t G = out_grad ? m.head_groups_ : 1, hq = H / G, hk = Hkv / G;
    Tensor keys, keys_leaf, dkeys;
    const int64_t kc = KeyChunk(m);
    if (kl_grad) {
      if (folded) {  // without a graph, a chunk at a time (their backward is by chunks, below)
        std::vector<Tensor> parts;
        for (int64_t c0 = 0; c0 < S; c0 += kc) {
          torch::NoGradGuard no_grad;
          parts.push_back(m.indexer->Keys(NormedRows(*st, x, c0, std::min(kc, S - c0))));
        }
        keys = torch::cat(parts, 1);
      } else {
        torch::AutoGradMode grad(true);
        keys = m.indexer->Keys(x.detach());  // the indexer's input is detached
      }
      keys_leaf = keys.detach().requires_grad_(true);
      dkeys = torch::zeros(keys.sizes(), acc);
    }
    const int64_t tiles = (S + m.tile_ - 1) / m.tile_;
    for (int64_t g = 0; g < G; ++g) {
      const bool kl_here = kl_grad && g == 0;
      Tensor k, v, dk_acc, dv_acc;
      if (out_grad) {
        {
          torch::NoGradGuard no_grad;
          if (folded) {  // (B, hk, S, D), a tile of normalized rows at a time
            k = torch::empty({B, hk, S, D}, x.options());
            v = torch::empty({B, hk, S, D}, x.options());
            for (int64_t t0 = 0; t0 < S; t0 += m.tile_) {
              const int64_t n = std::min(m.tile_, S - t0);
              const Tensor xt = NormedRows(*st, x, t0, n);
              k.narrow(2, t0, n).copy_(HeadRows(m.k_proj, m.k_lora, xt, g * hk, hk, D));
              v.narrow(2, t0, n).copy_(HeadRows(m.v_proj, m.v_lora, xt, g * hk, hk, D));
            }
          } else {
            k = HeadRows(m.k_proj, m.k_lora, x, g * hk, hk, D);  // (B, hk, S, D)
            v = HeadRows(m.v_proj, m.v_lora, x, g * hk, hk, D);
          }
        }
        dk_acc = torch::zeros({B, hk, S, D}, acc);
        dv_acc = torch::zeros({B, hk, S, D}, acc);
      }
      for (int64_t i = tiles; i-- > 0;) {
        const int64_t t0 = i * m.tile_, n = std::min(m.tile_, S - t0);
        const Tensor xt = x.narrow(1, t0, n).detach().requires_grad_(true);
        Tensor xn = xt;  // the tile's normalized rows, with a graph back to xt
        if (folded) {
          torch::AutoGradMode grad(true);
          xn = st->norm->forward(xt);
        }
        const Tensor pool = pool_all.narrow(1, t0, n);
        std::vector<Tensor> outputs, grad_outputs, inputs = {xt};
        if (out_grad) {
          const auto [q, kt, vt] = TileProjections(m, xn, g * hq, hq, g * hk, hk);  // (B, hq | hk, n, D)
          const Tensor idx = kernels::ExpandPoolSelection(pool, t0);
          const Tensor gt = grads[0].narrow(1, t0, n).reshape({B, n, H, D}).narrow(2, g * hq, hq).transpose(1, 2);
          RECORD_USER_SCOPE("dsa sparse attention backward");
          Tensor dq = kernels::SparseAttentionBackward(gt, q.detach(), k, v, idx,
                                                       lse_all.narrow(1, g * hq, hq).narrow(2, t0, n), 0.0, dk_acc,
                                                       dv_acc);
          outputs.insert(outputs.end(), {q, kt, vt});
          grad_outputs.insert(grad_outputs.end(), {dq, dk_acc.narrow(2, t0, n).to(kt.scalar_type()),
                                                   dv_acc.narrow(2, t0, n).to(vt.scalar_type())});
        }
        if (kl_here) {
          Tensor iq, iw, kl;
          {
            torch::AutoGradMode grad(true);
            m.indexer->Queries(xn.detach(), &iq, &iw);
            kl = kernels::IndexerKlLoss(iq, keys_leaf, iw, pool, target_all.narrow(1, t0, n));
          }
          outputs.push_back(kl);
          grad_outputs.push_back(grads[1].to(kl.scalar_type()));
          inputs.push_back(keys_leaf);
        }
        inputs.insert(inputs.end(), weights.begin(), weights.end());
        std::vector<Tensor> d;
        {
          RECORD_USER_SCOPE("dsa backward: q, k, v projections and indexer kl");
          d = torch::autograd::grad(outputs, inputs, grad_outputs, /*retain_graph=*/false,
                                    /*create_graph=*/false, /*allow_unused=*/true);
        }
        if (d[0].defined()) dx.narrow(1, t0, n).add_(d[0]);
        size_t next = 1;
        if (kl_here && d[next].defined()) dkeys.add_(d[next]);
        if (kl_here) ++next;
        sums.Add(std::vector<Tensor>(d.begin() + static_cast<std::ptrdiff_t>(next), d.end()));
      }
    }
    grads.clear();  // the incoming gradient (one (T, H D)) is read
    if (kl_grad) {
      // The pooled keys back to the indexer's key-side weights (its input is detached: no dx).
      RECORD_USER_SCOPE("dsa backward: indexer key projections");
      if (folded) {  // chunk by chunk, each chunk's keys again with a graph
        for (int64_t c0 = 0; c0 < S; c0 += kc) {
          const Tensor xk = NormedRows(*st, x, c0, std::min(kc, S - c0));
          Tensor kchunk;
          {
            torch::AutoGradMode grad(true);
            kchunk = m.indexer->Keys(xk);
          }
          if (kchunk.size(1) == 0) continue;
          const Tensor dk = dkeys.narrow(1, c0 / 4, kchunk.size(1)).to(kchunk.scalar_type());
          sums.Add(torch::autograd::grad({kchunk}, weights, {dk}, /*retain_graph=*/false, /*create_graph=*/false,
                                         /*allow_unused=*/true));
        }
      } else {
        std::vector<Tensor> d = torch::autograd::grad({keys}, weights, {dkeys.to(keys.scalar_type())},
                                                      /*retain_graph=*/false, /*create_graph=*/false,
                                                      /*allow_unused=*/true);
        sums.Add(d);
      }
    }
    sums.WriteGrads();
    return {dx, Tensor()};
  }

  // The tiles without a graph. `saved` (optional) gets what backward needs; with `kl` the KL
  // summed over rows goes to saved->kl (0 otherwise). `sel`: a kept selection to replay (no
  // indexer scoring) or a host tensor to keep this pass's in (see set_selection_mode).
  static Tensor Run(DsaAttentionImpl& m, const Tensor& x, bool kl, Saved* saved, const DsaSelectionIo& sel) {
    const int64_t B = x.size(0), S = x.size(1), H = m.heads_, D = m.head_dim_, kp = m.top_pools_;
    const bool replay = sel.replay.defined();
    const Tensor k = m.SplitHeads(m.k_proj, m.k_lora, x);  // (B, Hkv, S, D)
    const Tensor v = m.SplitHeads(m.v_proj, m.v_lora, x);
    const Tensor keys = replay && !kl ? Tensor() : m.indexer->Keys(x);  // (B, S / 4, DI)
    Tensor out = torch::empty({B, S, H * D}, x.options());
    auto i32 = x.options().dtype(torch::kInt32);
    // The kernels compute in fp32 (fp64 for fp64 inputs); the KL leaves as fp32 (InjectAuxLoss).
    const auto ct = x.options().dtype(x.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32);
    Tensor kl_sum = torch::zeros({}, x.options().dtype(torch::kFloat32));
    if (saved != nullptr) {
      saved->pool_idx = torch::empty({B, S, kp}, i32);
      saved->lse = torch::empty({B, H, S}, ct);
      if (kl) saved->target = torch::empty({B, S, kp}, ct);
    }
    int64_t rows = 0;
    for (int64_t t0 = 0; t0 < S; t0 += m.tile_) {
      const int64_t n = std::min(m.tile_, S - t0);
      const Tensor xt = x.narrow(1, t0, n);
      const Tensor q = m.SplitHeads(m.q_proj, m.q_lora, xt);  // (B, H, n, D)
      Tensor iq, iw, pool, idx;  // pool: (B, n, kp); idx: (B, n, 4 kp + 3)
      {
        // (Phases for the profiler and odyssey-bench --phase-times: user scopes, free otherwise.)
        RECORD_USER_SCOPE(replay ? "dsa selection: replayed" : "dsa selection: indexer");
        if (!replay || kl) m.indexer->Queries(xt, &iq, &iw);
        if (replay) {
          pool = sel.replay.narrow(1, t0, n).to(x.device(), /*non_blocking=*/true);
        } else {
          kernels::DsaIndexerOptions o;
          o.top_k = kp;
          o.pool = 4;
          o.query_offset = t0;
          pool = kernels::IndexerTopK(iq, keys, iw, o);
          // Pinned host memory, on the stream: the tile's device copy is reused only after it.
          if (sel.record.defined()) sel.record.narrow(1, t0, n).copy_(pool, /*non_blocking=*/true);
        }
        idx = kernels::ExpandPoolSelection(pool, t0);
      }
      kernels::SparseAttentionResult r;
      {
        RECORD_USER_SCOPE("dsa sparse attention forward");
        r = kernels::SparseAttentionForward(q, k, v, idx);
      }
      out.narrow(1, t0, n).copy_(r.out.transpose(1, 2).reshape({B, n, H * D}));
      if (saved != nullptr) {
        saved->pool_idx.narrow(1, t0, n).copy_(pool);
        saved->lse.narrow(2, t0, n).copy_(r.lse);
      }
      if (kl && t0 + n >= 4) {
        // Rows t < 3 see no pool and add nothing (their target is all 0); every later row selects
        // at least the first pool, so the rows are counted without reading the selection back.
        RECORD_USER_SCOPE("dsa indexer kl: target and loss");
        const Tensor target = KlTarget(q, k, idx, pool, r.lse);
        kl_sum += kernels::IndexerKlLoss(iq, keys, iw, pool, target).to(torch::kFloat32);
        rows += B * (t0 + n - std::max<int64_t>(t0, 3));
        if (saved != nullptr) saved->target.narrow(1, t0, n).copy_(target);
      } else if (kl && saved != nullptr) {
        saved->target.narrow(1, t0, n).zero_();
      }
    }
    if (saved != nullptr) {
      saved->kl = kl_sum;
      saved->rows = rows;
    }
    return out;
  }
};

// x (B, L, hidden), this rank's shard -> (B, L, H D) and the KL of this rank's rows (fp32 0-d)
// over the group (DsaAttentionImpl::Heads). Saved: x, this rank's pool selection (B, L, kp)
// int32, its heads' log-sum-exp of the whole sequence (B, H/P, S) and, with kl, its rows' KL
// target (B, L, kp) fp32.
class DsaAttentionImpl::ShardedFunction : public torch::autograd::Function<ShardedFunction> {
 public:
  using Saved = TiledFunction::Saved;

  // The sequence's tiles for this layer: inside each shard, tiles of a multiple of P tokens (P
  // divides L), so every tile's queries split evenly: rank r holds rows [r n/P, (r+1) n/P) of each
  // tile for the indexer's selection and the KL (the part of the layer whose cost grows with the
  // query's position: split this way, the ranks share it evenly, where by shards the last rank
  // would score 2P - 1 times the first's). A rank's held rows, n/P per tile in tile order, are
  // L in all: its saved selection and KL target.
  static std::vector<ShardTile> Tiles(const DsaAttentionImpl& m, int P, int64_t L) {
    return ShardTiles(P, L, std::max<int64_t>(P, m.tile_ / P * P));
  }

  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& x,
                                                c10::intrusive_ptr<DsaTileState> st) {
    torch::NoGradGuard no_grad;
    Saved saved;
    Tensor out = Run(*st->mixer, *st->group, x, st->kl, &saved, st->selection);
    return TiledFunction::Keep(ctx, st, x, saved, std::move(out));
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto st = c10::static_intrusive_pointer_cast<DsaTileState>(ctx->saved_data["state"].toCapsule());
    const torch::autograd::variable_list sv = ctx->get_saved_variables();
    const Tensor &x = sv[0], &pool_all = sv[1], &lse = sv[2], &target_all = sv[3];
    DsaAttentionImpl& m = *st->mixer;
    const SequenceGroup& group = *st->group;
    const int P = group.size(), rank = group.rank();
    const int64_t B = x.size(0), L = x.size(1), S = P * L, D = m.head_dim_;
    const int64_t H = m.heads_ / P, Hkv = m.kv_heads_ / P;
    // Every rank of the group has the same graph: both flags agree over the ranks.
    const bool out_grad = grads[0].defined(), kl_grad = st->kl && grads.size() > 1 && grads[1].defined();
    if (!out_grad && !kl_grad) return {Tensor(), Tensor()};
    const std::vector<Tensor> weights = TiledFunction::TrainedWeights(m);
    Fp32GradSums sums(weights);
    const auto acc = torch::TensorOptions().dtype(x.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32)
                         .device(x.device());
    Tensor gh, k, v, dk_acc, dv_acc;  // this rank's heads of the whole sequence
    if (out_grad) {
      // (B, L, H_all D) -> (B, H, S, D): the output gradient of this rank's heads.
      gh = group.AllToAll(grads[0].reshape({B, L, P * H, D}).transpose(1, 2).contiguous(), 1, 2);
      k = torch::zeros({B, Hkv, S, D}, x.options());
      v = torch::zeros({B, Hkv, S, D}, x.options());
      torch::NoGradGuard no_grad;
      for (const ShardTile& t : Tiles(m, P, L)) {
        const Tensor xt = BroadcastRows(group, x, Tensor(), t, 0);
        k.narrow(2, t.start, t.n).copy_(HeadRows(m.k_proj, m.k_lora, xt, rank * Hkv, Hkv, D));
        v.narrow(2, t.start, t.n).copy_(HeadRows(m.v_proj, m.v_lora, xt, rank * Hkv, Hkv, D));
      }
      dk_acc = torch::zeros({B, Hkv, S, D}, acc);
      dv_acc = torch::zeros({B, Hkv, S, D}, acc);
    }
    grads[0] = Tensor();
    Tensor keys_local, keys_leaf, dkeys;
    if (kl_grad) {
      {
        torch::AutoGradMode grad(true);
        keys_local = m.indexer->Keys(x.detach());  // (B, L / 4, DI); the indexer's input is detached
      }
      keys_leaf = group.AllGather(keys_local.detach().contiguous(), 1).requires_grad_(true);  // (B, S / 4, DI)
      dkeys = torch::zeros(keys_leaf.sizes(), acc);
    }
    Tensor dx = torch::zeros_like(x), no_halo;
    const std::vector<ShardTile> tiles = Tiles(m, P, L);
    std::vector<int64_t> held(tiles.size() + 1, 0);  // the offset of each tile's held rows
    for (size_t i = 0; i < tiles.size(); ++i) held[i + 1] = held[i] + tiles[i].n / P;
    // From the last tile: once a tile's queries are done, no query left sees its keys, so their
    // gradient is final and goes back through this tile's k and v projections at once.
    for (size_t i = tiles.size(); i-- > 0;) {
      const ShardTile& t = tiles[i];
      const int64_t part = t.n / P;
      const Tensor xt = BroadcastRows(group, x, Tensor(), t, 0).requires_grad_(true);
      const Tensor my_pool = pool_all.narrow(1, held[i], part);
      const Tensor pool = group.AllGather(my_pool.contiguous(), 1);  // (B, n, kp)
      std::vector<Tensor> outputs, grad_outputs, inputs = {xt};
      if (out_grad) {
        const auto [q, kt, vt] = TiledFunction::TileProjections(m, xt, rank * H, H, rank * Hkv, Hkv);  // (B, H | Hkv, n, D)
        const Tensor idx = kernels::ExpandPoolSelection(pool, t.start);
        RECORD_USER_SCOPE("dsa sparse attention backward");
        Tensor dq = kernels::SparseAttentionBackward(gh.narrow(2, t.start, t.n), q.detach(), k, v, idx,
                                                     lse.narrow(2, t.start, t.n), 0.0, dk_acc, dv_acc);
        outputs.insert(outputs.end(), {q, kt, vt});
        grad_outputs.insert(grad_outputs.end(), {dq, dk_acc.narrow(2, t.start, t.n).to(kt.scalar_type()),
                                                 dv_acc.narrow(2, t.start, t.n).to(vt.scalar_type())});
      }
      const bool kl_here = kl_grad;  // every rank: its part of the tile's rows
      if (kl_here) {
        Tensor iq, iw, kl;
        {
          torch::AutoGradMode grad(true);
          // detached: the KL trains the indexer only
          m.indexer->Queries(xt.detach().narrow(1, rank * part, part), &iq, &iw);
          kl = kernels::IndexerKlLoss(iq, keys_leaf, iw, my_pool, target_all.narrow(1, held[i], part));
        }
        outputs.push_back(kl);
        grad_outputs.push_back(grads[1].to(kl.scalar_type()));
        inputs.push_back(keys_leaf);
      }
      inputs.insert(inputs.end(), weights.begin(), weights.end());
      std::vector<Tensor> d;
      if (!outputs.empty()) {
        RECORD_USER_SCOPE("dsa backward: projections and indexer kl");
        d = torch::autograd::grad(outputs, inputs, grad_outputs, /*retain_graph=*/false,
                                  /*create_graph=*/false, /*allow_unused=*/true);
      }
      AddTileGradient(group, !d.empty() && d[0].defined() ? d[0] : torch::zeros_like(xt), t, 0, dx, no_halo);
      if (d.empty()) continue;
      size_t next = 1;
      if (kl_here && d[next].defined()) dkeys.add_(d[next]);
      if (kl_here) ++next;
      sums.Add(std::vector<Tensor>(d.begin() + static_cast<std::ptrdiff_t>(next), d.end()));
    }
    if (kl_grad) {
      // The pooled keys' gradient from every rank's rows, summed; this rank's pools go back
      // through its own key projections.
      group.AllReduceSum(dkeys);
      const int64_t pools = keys_local.size(1);
      std::vector<Tensor> d = torch::autograd::grad({keys_local}, weights,
                                                    {dkeys.narrow(1, rank * pools, pools).to(keys_local.scalar_type())},
                                                    /*retain_graph=*/false, /*create_graph=*/false,
                                                    /*allow_unused=*/true);
      sums.Add(d);
    }
    sums.WriteGrads();
    return {dx, Tensor()};
  }

  // The tiles without a graph (see forward and DsaAttentionImpl::Heads).
  static Tensor Run(DsaAttentionImpl& m, const SequenceGroup& group, const Tensor& x, bool kl, Saved* saved,
                    const DsaSelectionIo& sel) {
    const int P = group.size(), rank = group.rank();
    const int64_t B = x.size(0), L = x.size(1), S = P * L, D = m.head_dim_, kp = m.top_pools_;
    const int64_t H = m.heads_ / P, Hkv = m.kv_heads_ / P;
    const bool replay = sel.replay.defined();  // a kept selection: no indexer scoring
    const auto i32 = x.options().dtype(torch::kInt32);
    const auto ct = x.options().dtype(x.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32);
    // The pooled indexer keys of the whole sequence (pools count from its first token: 4 | L).
    const Tensor keys = replay && !kl ? Tensor() : group.AllGather(m.indexer->Keys(x).contiguous(), 1);
    const Tensor k = torch::zeros({B, Hkv, S, D}, x.options());
    const Tensor v = torch::zeros({B, Hkv, S, D}, x.options());
    Tensor heads = torch::empty({B, H, S, D}, x.options());
    Tensor kl_sum = torch::zeros({}, x.options().dtype(torch::kFloat32));
    Tensor held_pools = torch::empty({B, L, kp}, i32);  // this rank's held rows' selections (Tiles)
    if (saved != nullptr) {
      saved->pool_idx = held_pools;
      saved->lse = torch::empty({B, H, S}, ct);
      if (kl) saved->target = torch::zeros({B, L, kp}, ct);
    }
    int64_t rows = 0, held = 0;
    for (const ShardTile& t : Tiles(m, P, L)) {
      const int64_t part = t.n / P, first = rank * part;
      const Tensor xt = BroadcastRows(group, x, Tensor(), t, 0);  // (B, n, hidden)
      // This rank's part of the tile's queries selects its pools; the tile's selection is the
      // parts gathered.
      Tensor iq, iw, my_pool;
      {
        RECORD_USER_SCOPE(replay ? "dsa selection: replayed" : "dsa selection: indexer");
        if (!replay || kl) m.indexer->Queries(xt.narrow(1, first, part), &iq, &iw);
        if (replay) {
          my_pool = sel.replay.narrow(1, held, part).to(x.device(), /*non_blocking=*/true);
        } else {
          kernels::DsaIndexerOptions o;
          o.top_k = kp;
          o.pool = 4;
          o.query_offset = t.start + first;
          my_pool = kernels::IndexerTopK(iq, keys, iw, o);
          // Pinned host memory, on the stream: the tile's device copy is reused only after it.
          if (sel.record.defined()) sel.record.narrow(1, held, part).copy_(my_pool, /*non_blocking=*/true);
        }
        held_pools.narrow(1, held, part).copy_(my_pool);
      }
      const Tensor pool = group.AllGather(my_pool.contiguous(), 1);  // (B, n, kp)
      k.narrow(2, t.start, t.n).copy_(HeadRows(m.k_proj, m.k_lora, xt, rank * Hkv, Hkv, D));
      v.narrow(2, t.start, t.n).copy_(HeadRows(m.v_proj, m.v_lora, xt, rank * Hkv, Hkv, D));
      const Tensor q = HeadRows(m.q_proj, m.q_lora, xt, rank * H, H, D);  // (B, H, n, D)
      const Tensor idx = kernels::ExpandPoolSelection(pool, t.start);
      kernels::SparseAttentionResult r;
      {
        RECORD_USER_SCOPE("dsa sparse attention forward");
        r = kernels::SparseAttentionForward(q, k, v, idx);
      }
      heads.narrow(2, t.start, t.n).copy_(r.out);
      if (saved != nullptr) saved->lse.narrow(2, t.start, t.n).copy_(r.lse);
      if (kl && t.start + t.n >= 4) {
        RECORD_USER_SCOPE("dsa indexer kl: target and loss");
        // Every rank the target of all heads, then the KL of its part of the rows.
        const Tensor target = KlTarget(q, k, idx, pool, r.lse, &group).narrow(1, first, part);
        kl_sum += kernels::IndexerKlLoss(iq, keys, iw, my_pool, target).to(torch::kFloat32);
        if (saved != nullptr) saved->target.narrow(1, held, part).copy_(target);
        // The whole sequence's rows on every rank: the ranks' KL shares add up to its mean.
        rows += B * (t.start + t.n - std::max<int64_t>(t.start, 3));
      }
      held += part;
    }
    if (saved != nullptr) {
      saved->kl = kl_sum;
      saved->rows = rows;
    }
    // (B, H, S, D) -> (B, H_all, L, D): this rank's positions of every head.
    return group.AllToAll(heads, 2, 1).transpose(1, 2).reshape({B, L, P * H * D});
  }
};

Tensor DsaAttentionImpl::SparseHeads(const Tensor& x_in, Kl* kl, const SequenceGroup* group, RMSNormImpl* norm) {
  const bool sharded = group != nullptr && group->size() > 1;
  // The norm runs inside the tiled Function only where it keeps x for a backward of its own.
  const bool fold = norm != nullptr && !sharded && torch::GradMode::is_enabled();
  const Tensor x = norm != nullptr && !fold ? norm->forward(x_in) : x_in;
  DsaSelectionIo sel;
  const int64_t B = x.size(0), S = x.size(1);
  if (selection_mode_ == SelectionMode::kReplay) {
    TORCH_CHECK(replay_cursor_ < kept_.size() && kept_[replay_cursor_].defined(),
                "DSA keep_selection: a replay pass found no kept selection for its document ", replay_cursor_,
                " (", kept_.size(), " kept): the layer's recompute ran without a first forward that kept one");
    sel.replay = kept_[replay_cursor_];
    TORCH_CHECK(sel.replay.size(0) == B && sel.replay.size(1) == S,
                "DSA keep_selection: the kept selection is for ", sel.replay.size(0), " x ", sel.replay.size(1),
                " tokens, the replay pass has ", B, " x ", S);
    // The last use: a replay with grad hands the selection to the Function, which keeps it.
    if (torch::GradMode::is_enabled()) kept_[replay_cursor_] = Tensor();
    ++replay_cursor_;
  } else if (selection_mode_ == SelectionMode::kRecord) {
    sel.record = torch::empty({B, S, top_pools_},
                              torch::TensorOptions().dtype(torch::kInt32).pinned_memory(x.is_cuda()));
    kept_.push_back(sel.record);
  }
  if (!torch::GradMode::is_enabled()) {
    TORCH_CHECK(kl == nullptr, "DSA: the indexer KL trains only with grad");
    if (sharded) return ShardedFunction::Run(*this, *group, x, /*kl=*/false, nullptr, sel);
    return TiledFunction::Run(*this, x, /*kl=*/false, nullptr, sel);
  }
  auto st = c10::make_intrusive<DsaTileState>();
  st->mixer = this;
  st->norm = fold ? norm : nullptr;
  st->group = sharded ? group : nullptr;
  st->selection = std::move(sel);
  st->kl = kl != nullptr && x.size(1) >= 4;
  // The Function records a backward node only for inputs that need grad; the layer's
  // parameters need it even when x does not.
  const Tensor input = x.requires_grad() ? x : x.detach().requires_grad_(true);
  torch::autograd::variable_list r = sharded ? ShardedFunction::apply(input, st) : TiledFunction::apply(input, st);
  st->selection = DsaSelectionIo{};  // the backward reads the Function's own saved selection
  if (st->kl) {
    kl->rows += st->rows;
    kl->sum = kl->sum.defined() ? kl->sum + r[1] : r[1];
  }
  return r[0];
}

Tensor DsaAttentionImpl::HeadsOfDocument(const Tensor& x_in, const AttentionBackend* backend, Kl* kl,
                                         RMSNormImpl* norm) {
  if (stage_ == IndexerStage::kSparse) return SparseHeads(x_in, kl, nullptr, norm);
  const Tensor x = norm != nullptr ? norm->forward(x_in) : x_in;
  const int64_t B = x.size(0), S = x.size(1), H = heads_, D = head_dim_;
  Tensor q = SplitHeads(q_proj, q_lora, x);  // (B, H, S, D)
  Tensor k = SplitHeads(k_proj, k_lora, x);  // (B, Hkv, S, D)
  Tensor v = SplitHeads(v_proj, v_lora, x);
  // The indexer sees a detached input: it learns only from its KL (spec 2.3). With the KL's
  // backward in the forward, its graph is built even when the forward runs without grad.
  DsaIndexerImpl::Out ix;
  if (kl != nullptr) {
    torch::AutoGradMode grad(KlGrad());
    ix = indexer(x.detach());  // with grad: the KL's path to the indexer
  }
  TORCH_CHECK(backend != nullptr, "DSA dense warm-up needs an attention backend");
  Tensor out = backend->Forward(q, k, v, AttentionMeta{});  // (B, H, S, D)
  if (kl != nullptr && S >= 4) {
    // Dense warm-up: the target is the main attention's probabilities (no grad), head-averaged,
    // summed within each pool and L1-normalised; the prediction the softmax of the indexer's pool
    // scores over every visible pool (kernels::DenseWarmupKl: query blocks, one block's transients
    // at a time, its gradients formed in the forward when they are wanted). Every row from position 3
    // on sees pool 0.
    torch::AutoGradMode grad(KlGrad());
    const Tensor total = kernels::DenseWarmupKl(ix.q, ix.keys, ix.w, q, k,
                                                kernels::DenseWarmupKlBlockFor(ix.q, q, k));
    kl->rows += B * (S - 3);
    kl->sum = kl->sum.defined() ? kl->sum + total : total;
  }
  return out.transpose(1, 2).reshape({B, S, H * D});
}

Tensor DsaAttentionImpl::Heads(const Tensor& x, const AttentionMeta& meta, const AttentionBackend* backend,
                               Tensor* indexer_loss, const SequenceGroup* group, RMSNormImpl* input_norm) {
  TORCH_CHECK(!backward_in_forward_ || stage_ == IndexerStage::kDenseWarmup,
              "DSA: the indexer's backward in the forward is for the dense_warmup stage only");
  bool trains = indexer_loss != nullptr && loss_weight_ > 0 && KlGrad();
  if (trains) {
    bool any = false;
    for (const auto& p : indexer->parameters()) any = any || p.requires_grad();
    trains = any;
  }
  Kl kl;
  Tensor y;
  if (group != nullptr && group->size() > 1) {
    const int P = group->size();
    CheckNotPacked(meta, "DSA");
    TORCH_CHECK(stage_ == IndexerStage::kSparse,
                "DSA: the dense_warmup indexer stage is not implemented with context parallelism (train it on one "
                "rank per sequence, or use the sparse stage)");
    TORCH_CHECK(head_groups_ == 1, "DSA: head_groups (", head_groups_,
                ") is not implemented with context parallelism (its ranks already split the heads)");
    TORCH_CHECK(heads_ % P == 0 && kv_heads_ % P == 0, "DSA: context_parallel (", P,
                ") must divide the layer's query heads (", heads_, ") and KV heads (", kv_heads_, ")");
    TORCH_CHECK(x.size(1) % 4 == 0, "DSA: a context-parallel rank's positions (", x.size(1),
                ") must be a multiple of 4 (the indexer's pools count from the sequence's first token)");
    y = SparseHeads(x, trains ? &kl : nullptr, group, input_norm);
  } else {
    y = PerDocument(x, meta, [&](const Tensor& xd) {
      return HeadsOfDocument(xd, backend, trains ? &kl : nullptr, input_norm);
    });
  }
  if (trains && kl.sum.defined()) {
    torch::AutoGradMode grad(KlGrad());
    Tensor loss = kl.sum / static_cast<double>(std::max<int64_t>(1, kl.rows));
    last_loss_ = loss.detach();
    if (backward_in_forward_) {
      // The gradient InjectAuxLoss would send back, sent now.
      torch::autograd::backward({loss}, {torch::full({}, loss_weight_ * gradient_scale_, loss.options())});
    } else {
      *indexer_loss = loss;
    }
  }
  return y;
}

Tensor InjectAuxLoss(const Tensor& out, const Tensor& aux, double weight) {
  return AuxLossFunction::apply(out, aux, weight);
}

bool IsFp32Parameter(const std::string& name) {
  auto ends = [&](const std::string& suffix) {
    return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  return ends(".A_log") || ends(".dt_bias");
}

}  // namespace odyssey::model
