#include "model/attention.h"

#include <cmath>

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

class AutoAttention final : public AttentionBackend {
 public:
  std::string name() const override { return "auto"; }

 protected:
  torch::Tensor Causal(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       double scale) const override {
    return q.is_cuda() ? sdpa_.CausalPublic(q, k, v, scale) : math_.CausalPublic(q, k, v, scale);
  }

 private:
  template <typename B>
  struct Exposed : B {
    torch::Tensor CausalPublic(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               double scale) const {
      return this->Causal(q, k, v, scale);
    }
  };
  Exposed<SdpaAttention> sdpa_;
  Exposed<MathAttention> math_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<const AttentionBackend>> MakeAttentionBackend(const std::string& kind) {
  if (kind == "math") return std::make_shared<const MathAttention>();
  if (kind == "sdpa") return std::make_shared<const SdpaAttention>();
  if (kind == "auto" || kind.empty()) return std::make_shared<const AutoAttention>();
  return absl::InvalidArgumentError(absl::StrCat("attention backend '", kind, "' is not one of auto, math, sdpa"));
}

}  // namespace odyssey::model
