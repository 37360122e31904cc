// The attention seam: every attention layer calls one AttentionBackend, so kernels (ATen SDPA,
// cuDNN, head-chunked, context-parallel, sparse) slot in without touching the layer math.
//
// Shapes: q (B, Hq, S, D), k and v (B, Hkv, S, D) with Hkv dividing Hq (GQA); the output has
// q's shape. Attention is causal; with packed rows (doc_lens) it is causal within each
// document and never crosses a document boundary.
// Thread safety: backends hold no mutable state and may be shared.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <torch/types.h>

#include "absl/status/statusor.h"

namespace odyssey::model {

struct AttentionMeta {
  // Per row of the batch, the lengths of packed documents (summing to S); empty = one document.
  const std::vector<std::vector<int64_t>>* doc_lens = nullptr;
  double scale = 0.0;  // softmax scale; 0 = 1/sqrt(D)
};

class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;
  virtual std::string name() const = 0;
  // Splits packed rows into documents and runs Causal() on each.
  torch::Tensor Forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const AttentionMeta& meta) const;

 protected:
  // Plain causal attention over whole rows. REQUIRES: shapes as in the file comment.
  virtual torch::Tensor Causal(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               double scale) const = 0;
};

// "math": explicit matmul + softmax in fp32 (any device; the CPU reference path).
// "sdpa": ATen scaled_dot_product_attention (flash / cuDNN / efficient on CUDA).
// "auto": sdpa on CUDA tensors, math elsewhere.
absl::StatusOr<std::shared_ptr<const AttentionBackend>> MakeAttentionBackend(const std::string& kind);

}  // namespace odyssey::model
