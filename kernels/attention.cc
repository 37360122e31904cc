#include "kernels/attention.h"

#include <cmath>

#include <algorithm>
#include <array>
#include <atomic>
#include <limits>
#include <optional>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "kernels/heads.h"

namespace odyssey::kernels {

torch::Tensor AttentionBackend::Forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                        const AttentionMeta& meta) const {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attention expects (B, H, S, D) tensors");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "kv heads must divide q heads");
  const double scale = meta.scale > 0 ? meta.scale : 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  const bool packed = meta.doc_lens != nullptr &&
                      std::any_of(meta.doc_lens->begin(), meta.doc_lens->end(),
                                  [](const auto& row) { return row.size() > 1; });
  if (!packed) return Causal(q, k, v, scale);
  TORCH_CHECK(static_cast<int64_t>(meta.doc_lens->size()) == q.size(0), "doc_lens needs one entry per row");
  std::vector<torch::Tensor> rows;
  rows.reserve(q.size(0));
  for (int64_t b = 0; b < q.size(0); ++b) {
    const auto& lens = (*meta.doc_lens)[b];
    if (lens.size() <= 1) {
      rows.push_back(Causal(q.narrow(0, b, 1), k.narrow(0, b, 1), v.narrow(0, b, 1), scale));
      continue;
    }
    std::vector<torch::Tensor> docs;
    int64_t start = 0;
    for (int64_t len : lens) {
      docs.push_back(Causal(q.narrow(0, b, 1).narrow(2, start, len), k.narrow(0, b, 1).narrow(2, start, len),
                            v.narrow(0, b, 1).narrow(2, start, len), scale));
      start += len;
    }
    TORCH_CHECK(start == q.size(2), "doc_lens of row ", b, " sum to ", start, ", not S=", q.size(2));
    rows.push_back(torch::cat(docs, 2));  // (1, Hq, S, D)
  }
  return torch::cat(rows, 0);  // (B, Hq, S, D)
}

std::pair<torch::Tensor, AttentionStats> AttentionBackend::CausalWithStats(const torch::Tensor&, const torch::Tensor&,
                                                                           const torch::Tensor&, double) const {
  TORCH_CHECK(false, "attention backend ", name(), " does not expose its statistics");
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> AttentionBackend::CausalBackward(
    const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
    const AttentionStats&, double) const {
  TORCH_CHECK(false, "attention backend ", name(), " has no separate backward");
}

namespace {

std::atomic<bool> g_cudnn_expand_kv{false};
bool CudnnExpandsKv() { return g_cudnn_expand_kv.load(std::memory_order_relaxed); }

// k, v (B, Hkv, S, D) -> (B, Hq, S, D) for kernels that need one KV head per query head.
torch::Tensor ExpandKv(const torch::Tensor& t, int64_t q_heads) { return RepeatHeads(t, q_heads / t.size(1)); }
// The reverse for gradients: (B, Hq, S, D) -> (B, Hkv, S, D), summing each KV head's queries.
torch::Tensor ReduceKv(const torch::Tensor& g, int64_t kv_heads) { return SumHeadRepeats(g, kv_heads); }

class MathAttention : public AttentionBackend {
 public:
  std::string name() const override { return "math"; }
  bool SupportsStats(const torch::Device&) const override { return true; }

  std::pair<torch::Tensor, AttentionStats> CausalWithStats(const torch::Tensor& q, const torch::Tensor& k,
                                                           const torch::Tensor& v, double scale) const override {
    torch::Tensor scores = Scores(q, k, scale);                       // (B, Hq, S, S) fp32, masked
    AttentionStats stats;
    stats.lse = torch::logsumexp(scores, -1);                         // (B, Hq, S)
    torch::Tensor probs = torch::softmax(scores, -1).to(q.scalar_type());
    return {torch::matmul(probs, ExpandKv(v, q.size(1))), stats};   // (B, Hq, S, D)
  }

  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> CausalBackward(
      const torch::Tensor& grad_out, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
      const torch::Tensor& out, const AttentionStats& stats, double scale) const override {
    torch::Tensor kr = ExpandKv(k, q.size(1)), vr = ExpandKv(v, q.size(1));
    torch::Tensor p = torch::exp(Scores(q, k, scale) - stats.lse.unsqueeze(-1));  // (B, Hq, S, S) fp32
    torch::Tensor g = grad_out.to(torch::kFloat32);
    torch::Tensor dv = torch::matmul(p.transpose(2, 3), g);                          // (B, Hq, S, D)
    torch::Tensor dp = torch::matmul(g, vr.to(torch::kFloat32).transpose(2, 3));     // (B, Hq, S, S)
    torch::Tensor delta = (g * out.to(torch::kFloat32)).sum(-1, /*keepdim=*/true);   // (B, Hq, S, 1)
    torch::Tensor ds = p * (dp - delta) * scale;                                     // (B, Hq, S, S)
    torch::Tensor dq = torch::matmul(ds, kr.to(torch::kFloat32));
    torch::Tensor dk = torch::matmul(ds.transpose(2, 3), q.to(torch::kFloat32));
    const auto t = q.scalar_type();
    return {dq.to(t), ReduceKv(dk, k.size(1)).to(t), ReduceKv(dv, v.size(1)).to(t)};
  }

  torch::Tensor Causal(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       double scale) const override {
    torch::Tensor scores = torch::matmul(q, ExpandKv(k, q.size(1)).transpose(2, 3)) * scale;  // (B, Hq, S, S)
    scores = scores.masked_fill(CausalMask(q), -std::numeric_limits<float>::infinity());
    torch::Tensor probs = torch::softmax(scores, -1, torch::kFloat32).to(q.scalar_type());
    return torch::matmul(probs, ExpandKv(v, q.size(1)));  // (B, Hq, S, D)
  }

 private:
  static torch::Tensor CausalMask(const torch::Tensor& q) {
    const int64_t S = q.size(2);
    return torch::ones({S, S}, torch::TensorOptions().dtype(torch::kBool).device(q.device())).triu(1);
  }
  // Masked scores in fp32, the same values Causal() feeds its softmax.
  static torch::Tensor Scores(const torch::Tensor& q, const torch::Tensor& k, double scale) {
    torch::Tensor scores = (torch::matmul(q, ExpandKv(k, q.size(1)).transpose(2, 3)) * scale).to(torch::kFloat32);
    return scores.masked_fill(CausalMask(q), -std::numeric_limits<float>::infinity());
  }
};

class SdpaAttention : public AttentionBackend {
 public:
  std::string name() const override { return "sdpa"; }

  torch::Tensor Causal(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       double scale) const override {
    return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true,
                                            scale, /*enable_gqa=*/q.size(1) != k.size(1));
  }
};

// Puts cuDNN first in ATen's SDPA priority order for its lifetime. The order is process-global
// in ATen; it is set around each call and restored, since one training thread owns the
// process's attention calls.
class CudnnFirst {
 public:
  CudnnFirst() : saved_(at::globalContext().sDPPriorityOrder()) {
    std::vector<int64_t> order = {static_cast<int64_t>(at::SDPBackend::cudnn_attention)};
    for (at::SDPBackend b : saved_) {
      if (b != at::SDPBackend::cudnn_attention) order.push_back(static_cast<int64_t>(b));
    }
    at::globalContext().setSDPPriorityOrder(order);
  }
  ~CudnnFirst() {
    std::vector<int64_t> restore;
    for (at::SDPBackend b : saved_) restore.push_back(static_cast<int64_t>(b));
    at::globalContext().setSDPPriorityOrder(restore);
  }
  CudnnFirst(const CudnnFirst&) = delete;
  CudnnFirst& operator=(const CudnnFirst&) = delete;

 private:
  std::array<at::SDPBackend, at::num_sdp_backends> saved_;
};

class CudnnAttention : public AttentionBackend {
 public:
  std::string name() const override { return "cudnn"; }

  torch::Tensor Causal(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       double scale) const override {
    CudnnFirst order;
    return at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true, scale,
                                            /*enable_gqa=*/q.size(1) != k.size(1));
  }

  // The cuDNN kernels called directly (what SDPA's cuDNN path calls). K/V go in with their own
  // KV heads (cuDNN's grouped-query support) when they are dense (a permutation of a contiguous
  // tensor: the whole K/V of a layer). Otherwise, or when SetCudnnExpandKv(true) asks for it,
  // K/V are expanded to one head per query head and the gradients summed back per KV head: a
  // head group's K/V are a slice of the layer's heads, whose sequence stride spans the other
  // groups' heads too, and the grouped-query backward on such a slice gave wrong gradients
  // (MemoryStrategyGpuTest, kept attention with 2 head groups of 2 KV heads each, on one H200).
  bool SupportsStats(const torch::Device& device) const override { return device.is_cuda(); }

  static bool Expand(const torch::Tensor& k, const torch::Tensor& v) {
    return CudnnExpandsKv() || !k.is_non_overlapping_and_dense() || !v.is_non_overlapping_and_dense();
  }

  std::pair<torch::Tensor, AttentionStats> CausalWithStats(const torch::Tensor& q, const torch::Tensor& k,
                                                           const torch::Tensor& v, double scale) const override {
    const bool expand = Expand(k, v);
    auto r = at::_scaled_dot_product_cudnn_attention(q, expand ? ExpandKv(k, q.size(1)) : k,
                                                     expand ? ExpandKv(v, q.size(1)) : v, std::nullopt,
                                                     /*compute_log_sumexp=*/true, 0.0, /*is_causal=*/true,
                                                     /*return_debug_mask=*/false, scale);
    AttentionStats stats;
    stats.lse = std::get<1>(r);
    stats.extra = {std::get<2>(r), std::get<3>(r), std::get<6>(r), std::get<7>(r)};  // cum_q, cum_k, seed, offset
    stats.max_q = std::get<4>(r).expect_int();
    stats.max_k = std::get<5>(r).expect_int();
    return {std::get<0>(r), stats};
  }

  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> CausalBackward(
      const torch::Tensor& grad_out, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
      const torch::Tensor& out, const AttentionStats& st, double scale) const override {
    const bool expand = Expand(k, v);  // as the forward decided: the same views come back
    auto [dq, dk, dv] = at::_scaled_dot_product_cudnn_attention_backward(
        grad_out.contiguous(), q, expand ? ExpandKv(k, q.size(1)) : k, expand ? ExpandKv(v, q.size(1)) : v, out,
        st.lse, st.extra[2], st.extra[3], torch::Tensor(), st.extra[0], st.extra[1], st.max_q, st.max_k, 0.0,
        /*is_causal=*/true, scale);
    // Expanded: one gradient per query head, summed per KV head here; native: cuDNN sums them.
    return {dq, ReduceKv(dk, k.size(1)), ReduceKv(dv, v.size(1))};
  }
};

class AutoAttention final : public AttentionBackend {
 public:
  std::string name() const override { return "auto"; }

  torch::Tensor Causal(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       double scale) const override {
    return Pick(q).Causal(q, k, v, scale);
  }
  bool SupportsStats(const torch::Device& device) const override { return true; }
  std::pair<torch::Tensor, AttentionStats> CausalWithStats(const torch::Tensor& q, const torch::Tensor& k,
                                                           const torch::Tensor& v, double scale) const override {
    return Pick(q).CausalWithStats(q, k, v, scale);
  }
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> CausalBackward(
      const torch::Tensor& grad_out, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
      const torch::Tensor& out, const AttentionStats& stats, double scale) const override {
    return Pick(q).CausalBackward(grad_out, q, k, v, out, stats, scale);
  }

 private:
  const AttentionBackend& Pick(const torch::Tensor& q) const {
    return q.is_cuda() ? static_cast<const AttentionBackend&>(cudnn_) : math_;
  }
  CudnnAttention cudnn_;
  MathAttention math_;
};

// Runs the inner backend over groups of KV heads (with their query heads) one after another.
// GQA maps query head h to KV head h / (Hq / Hkv), so contiguous query-head blocks pair with
// contiguous KV-head blocks. Each group's kernel call (and, in backward, its gradient call)
// holds only that group's working memory.
class HeadChunkedAttention final : public AttentionBackend {
 public:
  HeadChunkedAttention(std::shared_ptr<const AttentionBackend> inner, int64_t groups)
      : inner_(std::move(inner)), groups_(groups) {}
  std::string name() const override { return absl::StrCat(inner_->name(), "/", groups_, "-head-groups"); }

  torch::Tensor Causal(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       double scale) const override {
    TORCH_CHECK(k.size(1) % groups_ == 0, "head groups (", groups_, ") must divide the KV heads (", k.size(1), ")");
    const int64_t kv_per = k.size(1) / groups_, q_per = q.size(1) / groups_;
    // Each group writes into its slice of one (B, S, Hq, D) buffer: the layout the output
    // projection reads, so neither a concatenation nor the projection's reshape copies it.
    torch::Tensor out = torch::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options());  // (B, S, Hq, D)
    AttentionMeta meta;
    meta.scale = scale;
    for (int64_t g = 0; g < groups_; ++g) {
      torch::Tensor o = inner_->Forward(q.narrow(1, g * q_per, q_per), k.narrow(1, g * kv_per, kv_per),
                                        v.narrow(1, g * kv_per, kv_per), meta);  // (B, Hq/G, S, D)
      out.narrow(2, g * q_per, q_per).copy_(o.transpose(1, 2));
    }
    return out.transpose(1, 2);  // (B, Hq, S, D) view
  }

 private:
  std::shared_ptr<const AttentionBackend> inner_;
  int64_t groups_;
};

}  // namespace

std::string SdpaKernelFor(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, bool cudnn_first) {
  std::optional<CudnnFirst> order;
  if (cudnn_first) order.emplace();
  const int64_t choice = at::_fused_sdp_choice(q, k, v, {}, 0.0, /*is_causal=*/true, std::nullopt,
                                               /*enable_gqa=*/q.size(1) != k.size(1));
  switch (static_cast<at::SDPBackend>(choice)) {
    case at::SDPBackend::flash_attention: return "flash";
    case at::SDPBackend::efficient_attention: return "efficient";
    case at::SDPBackend::math: return "math";
    case at::SDPBackend::cudnn_attention: return "cudnn";
    default: return absl::StrCat("backend ", choice);
  }
}

absl::StatusOr<std::shared_ptr<const AttentionBackend>> MakeAttentionBackend(const std::string& kind,
                                                                             int64_t head_groups) {
  std::shared_ptr<const AttentionBackend> backend;
  if (kind == "math") {
    backend = std::make_shared<const MathAttention>();
  } else if (kind == "sdpa") {
    backend = std::make_shared<const SdpaAttention>();
  } else if (kind == "cudnn") {
    backend = std::make_shared<const CudnnAttention>();
  } else if (kind == "auto" || kind.empty()) {
    backend = std::make_shared<const AutoAttention>();
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("attention backend '", kind, "' is not one of auto, math, sdpa, cudnn"));
  }
  if (head_groups < 1)
    return absl::InvalidArgumentError(absl::StrCat("attention head_groups (", head_groups, ") must be >= 1"));
  return WrapHeadGroups(std::move(backend), head_groups);
}

std::shared_ptr<const AttentionBackend> WrapHeadGroups(std::shared_ptr<const AttentionBackend> inner, int64_t groups) {
  if (groups <= 1) return inner;
  return std::make_shared<const HeadChunkedAttention>(std::move(inner), groups);
}

torch::Tensor RepeatHeads(const torch::Tensor& t, int64_t factor) {
  return factor > 1 ? t.repeat_interleave(factor, 1) : t;
}

torch::Tensor SumHeadRepeats(const torch::Tensor& g, int64_t heads) {
  const int64_t f = g.size(1) / heads;
  if (f == 1) return g;
  return g.view({g.size(0), heads, f, g.size(2), g.size(3)}).sum(2);
}

void SetCudnnExpandKv(bool expand) { g_cudnn_expand_kv.store(expand, std::memory_order_relaxed); }

}  // namespace odyssey::kernels
