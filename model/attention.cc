#include "model/attention.h"

#include <cmath>

#include <array>
#include <optional>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"

namespace odyssey::model {

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

namespace {

class MathAttention : public AttentionBackend {
 public:
  std::string name() const override { return "math"; }

 protected:
  torch::Tensor Causal(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       double scale) const override {
    const int64_t groups = q.size(1) / k.size(1);
    const int64_t S = q.size(2);
    torch::Tensor kr = groups > 1 ? k.repeat_interleave(groups, 1) : k;  // (B, Hq, S, D)
    torch::Tensor vr = groups > 1 ? v.repeat_interleave(groups, 1) : v;
    torch::Tensor scores = torch::matmul(q, kr.transpose(2, 3)) * scale;  // (B, Hq, S, S)
    torch::Tensor mask = torch::ones({S, S}, torch::TensorOptions().dtype(torch::kBool).device(q.device())).triu(1);
    scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
    torch::Tensor probs = torch::softmax(scores, -1, torch::kFloat32).to(q.scalar_type());
    return torch::matmul(probs, vr);  // (B, Hq, S, D)
  }
};

class SdpaAttention : public AttentionBackend {
 public:
  std::string name() const override { return "sdpa"; }

 protected:
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

 protected:
  torch::Tensor Causal(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       double scale) const override {
    CudnnFirst order;
    return at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true, scale,
                                            /*enable_gqa=*/q.size(1) != k.size(1));
  }
};

template <typename B>
struct Exposed : B {
  torch::Tensor CausalPublic(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             double scale) const {
    return this->Causal(q, k, v, scale);
  }
};

class AutoAttention final : public AttentionBackend {
 public:
  std::string name() const override { return "auto"; }

 protected:
  torch::Tensor Causal(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       double scale) const override {
    return q.is_cuda() ? cudnn_.CausalPublic(q, k, v, scale) : math_.CausalPublic(q, k, v, scale);
  }

 private:
  Exposed<CudnnAttention> cudnn_;
  Exposed<MathAttention> math_;
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

 protected:
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
  if (head_groups == 1) return backend;
  return std::make_shared<const HeadChunkedAttention>(std::move(backend), head_groups);
}

}  // namespace odyssey::model
