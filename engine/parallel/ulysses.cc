#include "engine/parallel/ulysses.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "kernels/heads.h"

namespace odyssey::engine {

namespace {

// The non-differentiable all-to-all of the rounds' own forward and backward: a failed
// collective is exceptional here (it breaks the group), so it throws.
torch::Tensor AllToAllOrThrow(Communicator& comm, const torch::Tensor& x, int64_t split_dim, int64_t concat_dim) {
  absl::StatusOr<torch::Tensor> y = comm.AllToAll(x, split_dim, concat_dim);
  TORCH_CHECK(y.ok(), "context-parallel all-to-all failed: ", y.status().ToString());
  return *std::move(y);
}

struct CommHolder : torch::CustomClassHolder {
  Communicator* comm = nullptr;
};

class AllToAllFunction : public torch::autograd::Function<AllToAllFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x, int64_t split_dim,
                               int64_t concat_dim, c10::intrusive_ptr<CommHolder> comm) {
    ctx->saved_data["split"] = split_dim;
    ctx->saved_data["concat"] = concat_dim;
    ctx->saved_data["comm"] = c10::IValue::make_capsule(comm);
    return AllToAllOrThrow(*comm->comm, x, split_dim, concat_dim);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto comm = c10::static_intrusive_pointer_cast<CommHolder>(ctx->saved_data["comm"].toCapsule());
    torch::Tensor g;
    // Every rank back-propagates through the same graph, so an undefined gradient (an unused
    // output) is undefined on every rank alike and skipping the collective keeps them in step.
    if (grads[0].defined())
      g = AllToAllOrThrow(*comm->comm, grads[0], ctx->saved_data["concat"].toInt(), ctx->saved_data["split"].toInt());
    return {g, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// KV heads repeated so that P ranks' blocks of query heads each find theirs: (B, n, s, D) ->
// (B, lcm(n, P), s, D), each head repeated lcm / n times in place (differentiable).
int64_t KvRepeats(int64_t n, int64_t P) { return P / std::gcd(n, P); }
torch::Tensor RepeatKv(const torch::Tensor& t, int64_t P) { return kernels::RepeatHeads(t, KvRepeats(t.size(1), P)); }

struct StatsState : torch::CustomClassHolder {
  const UlyssesAttention* backend = nullptr;  // the model's backend: it outlives every graph
  torch::Tensor out;                          // (B, Hq, S/P, D), without autograd history
  kernels::AttentionStats stats;
  double scale = 0;
};

// Head rounds as one autograd node: forward keeps the sharded output and lse, backward redoes
// the rounds with the inner kernel's backward (see the header).
class StatsRoundsFunction : public torch::autograd::Function<StatsRoundsFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor q, torch::Tensor k,
                               torch::Tensor v, c10::intrusive_ptr<StatsState> state) {
    auto [out, stats] = state->backend->CausalWithStats(q, k, v, state->scale);
    state->out = out;
    state->stats = std::move(stats);
    ctx->save_for_backward({q, k, v});
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return out.detach();  // its own autograd identity: the state does not hold the graph's output
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto state = c10::static_intrusive_pointer_cast<StatsState>(ctx->saved_data["state"].toCapsule());
    auto saved = ctx->get_saved_variables();
    auto [dq, dk, dv] =
        state->backend->CausalBackward(grads[0], saved[0], saved[1], saved[2], state->out, state->stats, state->scale);
    ctx->saved_data.clear();  // the output and lse are not needed any more
    return {dq, dk, dv, torch::Tensor()};
  }
};

bool Packed(const kernels::AttentionMeta& meta) {
  return meta.doc_lens != nullptr && std::any_of(meta.doc_lens->begin(), meta.doc_lens->end(),
                                                 [](const auto& row) { return row.size() > 1; });
}

}  // namespace

torch::Tensor DifferentiableAllToAll(Communicator& comm, const torch::Tensor& x, int64_t split_dim,
                                     int64_t concat_dim) {
  auto holder = c10::make_intrusive<CommHolder>();
  holder->comm = &comm;
  return AllToAllFunction::apply(x, split_dim, concat_dim, holder);
}

absl::Status ValidateContextParallel(int64_t P, int64_t head_chunk, int64_t num_attention_heads,
                                     int64_t num_key_value_heads, int64_t seq_len) {
  const int64_t Hq = num_attention_heads, Hkv = num_key_value_heads;
  if (P < 1) return absl::InvalidArgumentError(absl::StrCat("context_parallel (", P, ") must be >= 1"));
  if (Hq % P != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("context_parallel (", P, ") must divide num_attention_heads (", Hq, ")"));
  if (seq_len > 0 && seq_len % P != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("context_parallel (", P, ") must divide data.seq_len (", seq_len, ")"));
  if (head_chunk < 0)
    return absl::InvalidArgumentError(
        absl::StrCat("context_parallel.head_chunk (", head_chunk, ") must be >= 0 (0: all heads)"));
  if (head_chunk == 0) return absl::OkStatus();
  if (head_chunk % P != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("context_parallel (", P, ") must divide context_parallel.head_chunk (", head_chunk, ")"));
  if (Hq % head_chunk != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("context_parallel.head_chunk (", head_chunk, ") must divide num_attention_heads (", Hq, ")"));
  const int64_t per_kv = Hq / Hkv;  // query heads per KV head
  if (head_chunk % per_kv != 0 && per_kv % head_chunk != 0)
    return absl::InvalidArgumentError(absl::StrCat("context_parallel.head_chunk (", head_chunk,
                                                   ") must be a multiple or a divisor of the query heads per KV head (",
                                                   per_kv, ")"));
  return absl::OkStatus();
}

UlyssesAttention::UlyssesAttention(std::shared_ptr<const kernels::AttentionBackend> inner, Communicator& group,
                                   int64_t head_chunk)
    : inner_(std::move(inner)), group_(group), head_chunk_(head_chunk) {}

std::string UlyssesAttention::name() const {
  std::string rounds = head_chunk_ > 0 ? absl::StrCat(", ", head_chunk_, "-head rounds") : "";
  return absl::StrCat("ulysses(", group_.world_size(), rounds, ")/", inner_->name());
}

std::pair<int64_t, int64_t> UlyssesAttention::KvRange(int64_t h0, int64_t G, int64_t Hq, int64_t Hkv) {
  const int64_t per_kv = Hq / Hkv;
  return {h0 / per_kv, std::max<int64_t>(1, G / per_kv)};
}

void UlyssesAttention::CheckShapes(const torch::Tensor& q, const torch::Tensor& k) const {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4, "ulysses attention expects (B, H, S/P, D) tensors");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "kv heads must divide q heads");
  absl::Status s = ValidateContextParallel(group_.world_size(), head_chunk_, q.size(1), k.size(1), 0);
  TORCH_CHECK(s.ok(), s.ToString());
}

torch::Tensor UlyssesAttention::Forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                        const kernels::AttentionMeta& meta) const {
  CheckShapes(q, k);
  const int64_t P = group_.world_size(), Hq = q.size(1), Hkv = k.size(1), G = HeadsPerRound(Hq);
  kernels::AttentionMeta whole = meta;
  whole.scale = meta.scale > 0 ? meta.scale : 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  if (G < Hq && !Packed(meta) && inner_->SupportsStats(q.device())) {
    auto state = c10::make_intrusive<StatsState>();
    state->backend = this;
    state->scale = whole.scale;
    return StatsRoundsFunction::apply(q, k, v, state);
  }
  // One autograd graph per round (plain Ulysses is one round of all Hq heads).
  std::vector<torch::Tensor> outs;
  for (int64_t h0 = 0; h0 < Hq; h0 += G) {
    const auto [kv0, nkv] = KvRange(h0, G, Hq, Hkv);
    torch::Tensor qh = DifferentiableAllToAll(group_, q.narrow(1, h0, G), 1, 2);                     // (B, G/P, S, D)
    torch::Tensor kh = DifferentiableAllToAll(group_, RepeatKv(k.narrow(1, kv0, nkv), P), 1, 2);     // (B, lcm/P, S, D)
    torch::Tensor vh = DifferentiableAllToAll(group_, RepeatKv(v.narrow(1, kv0, nkv), P), 1, 2);
    torch::Tensor oh = inner_->Forward(qh, kh, vh, whole);                                           // (B, G/P, S, D)
    outs.push_back(DifferentiableAllToAll(group_, oh, 2, 1));                                        // (B, G, S/P, D)
  }
  return outs.size() == 1 ? outs[0] : torch::cat(outs, 1);  // (B, Hq, S/P, D)
}

torch::Tensor UlyssesAttention::Causal(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                       double scale) const {
  kernels::AttentionMeta meta;
  meta.scale = scale;
  return Forward(q, k, v, meta);
}

std::pair<torch::Tensor, kernels::AttentionStats> UlyssesAttention::CausalWithStats(const torch::Tensor& q,
                                                                                   const torch::Tensor& k,
                                                                                   const torch::Tensor& v,
                                                                                   double scale) const {
  CheckShapes(q, k);
  torch::NoGradGuard no_grad;
  const int64_t P = group_.world_size(), Hq = q.size(1), Hkv = k.size(1), G = HeadsPerRound(Hq);
  // Each round writes its heads into the one sharded output; the head-layout tensors of a
  // round are dropped before the next round allocates its own (the buffer set is reused).
  torch::Tensor out = torch::empty_like(q, at::MemoryFormat::Contiguous);  // (B, Hq, S/P, D)
  std::vector<torch::Tensor> lse;
  kernels::AttentionStats stats;
  for (int64_t h0 = 0; h0 < Hq; h0 += G) {
    const auto [kv0, nkv] = KvRange(h0, G, Hq, Hkv);
    torch::Tensor qh = AllToAllOrThrow(group_, q.narrow(1, h0, G), 1, 2);                  // (B, G/P, S, D)
    torch::Tensor kh = AllToAllOrThrow(group_, RepeatKv(k.narrow(1, kv0, nkv), P), 1, 2);  // (B, lcm/P, S, D)
    torch::Tensor vh = AllToAllOrThrow(group_, RepeatKv(v.narrow(1, kv0, nkv), P), 1, 2);
    auto [oh, st] = inner_->CausalWithStats(qh, kh, vh, scale);
    out.narrow(1, h0, G).copy_(AllToAllOrThrow(group_, oh, 2, 1));
    lse.push_back(AllToAllOrThrow(group_, st.lse, 2, 1));  // (B, G, S/P, ...)
    stats.extra.insert(stats.extra.end(), st.extra.begin(), st.extra.end());
    stats.max_q = st.max_q;
    stats.max_k = st.max_k;
  }
  stats.lse = lse.size() == 1 ? lse[0] : torch::cat(lse, 1);  // (B, Hq, S/P, ...)
  return {out, stats};
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> UlyssesAttention::CausalBackward(
    const torch::Tensor& grad_out, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const torch::Tensor& out, const kernels::AttentionStats& stats, double scale) const {
  CheckShapes(q, k);
  torch::NoGradGuard no_grad;
  const int64_t P = group_.world_size(), Hq = q.size(1), Hkv = k.size(1), G = HeadsPerRound(Hq);
  const int64_t rounds = Hq / G;
  const size_t extras = stats.extra.size() / static_cast<size_t>(rounds);
  torch::Tensor dq = torch::empty_like(q, at::MemoryFormat::Contiguous);  // (B, Hq, S/P, D)
  // KV gradients add up over the rounds whose queries share a KV head (chunk < heads per KV).
  torch::Tensor dk = torch::zeros_like(k, at::MemoryFormat::Contiguous);  // (B, Hkv, S/P, D)
  torch::Tensor dv = torch::zeros_like(v, at::MemoryFormat::Contiguous);
  for (int64_t r = 0, h0 = 0; r < rounds; ++r, h0 += G) {
    const auto [kv0, nkv] = KvRange(h0, G, Hq, Hkv);
    torch::Tensor qh = AllToAllOrThrow(group_, q.narrow(1, h0, G), 1, 2);                  // (B, G/P, S, D)
    torch::Tensor kh = AllToAllOrThrow(group_, RepeatKv(k.narrow(1, kv0, nkv), P), 1, 2);  // (B, lcm/P, S, D)
    torch::Tensor vh = AllToAllOrThrow(group_, RepeatKv(v.narrow(1, kv0, nkv), P), 1, 2);
    torch::Tensor oh = AllToAllOrThrow(group_, out.narrow(1, h0, G), 1, 2);                // (B, G/P, S, D)
    torch::Tensor gh = AllToAllOrThrow(group_, grad_out.narrow(1, h0, G), 1, 2);
    kernels::AttentionStats st;
    st.lse = AllToAllOrThrow(group_, stats.lse.narrow(1, h0, G), 1, 2);  // (B, G/P, S, ...)
    st.extra.assign(stats.extra.begin() + static_cast<std::ptrdiff_t>(r * extras),
                    stats.extra.begin() + static_cast<std::ptrdiff_t>((r + 1) * extras));
    st.max_q = stats.max_q;
    st.max_k = stats.max_k;
    auto [dqh, dkh, dvh] = inner_->CausalBackward(gh, qh, kh, vh, oh, st, scale);
    dq.narrow(1, h0, G).copy_(AllToAllOrThrow(group_, dqh, 2, 1));
    dk.narrow(1, kv0, nkv).add_(kernels::SumHeadRepeats(AllToAllOrThrow(group_, dkh, 2, 1), nkv));  // (B, nkv, S/P, D)
    dv.narrow(1, kv0, nkv).add_(kernels::SumHeadRepeats(AllToAllOrThrow(group_, dvh, 2, 1), nkv));
  }
  return {dq, dk, dv};
}

}  // namespace odyssey::engine
