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

// What a kernel's backward needs besides q, k, v and the output: the softmax log-sum-exp
// (B, Hq, S) fp32, and kernel-specific extras.
struct AttentionStats {
  torch::Tensor lse;
  std::vector<torch::Tensor> extra;
  int64_t max_q = 0, max_k = 0;
};

class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;
  virtual std::string name() const = 0;
  // Splits packed rows into documents and runs Causal() on each.
  torch::Tensor Forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const AttentionMeta& meta) const;

  // Plain causal attention over whole rows. REQUIRES: shapes as in the file comment.
  virtual torch::Tensor Causal(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               double scale) const = 0;

  // The forward with its statistics, and the backward kernel alone: a strategy that keeps a
  // layer's attention output from the first forward runs only the backward during the layer's
  // recompute. Backends without them report SupportsStats() false. For q, k, v on `device`.
  virtual bool SupportsStats(const torch::Device& device) const { return false; }
  virtual std::pair<torch::Tensor, AttentionStats> CausalWithStats(const torch::Tensor& q, const torch::Tensor& k,
                                                                   const torch::Tensor& v, double scale) const;
  // Returns (dq, dk, dv) for grad_out of `out`.
  virtual std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> CausalBackward(
      const torch::Tensor& grad_out, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
      const torch::Tensor& out, const AttentionStats& stats, double scale) const;
};

// "math": explicit matmul + softmax in fp32 (any device; the CPU reference path).
// "sdpa": ATen scaled_dot_product_attention with ATen's own choice of kernel.
// "cudnn": ATen SDPA with the cuDNN kernel first in the priority order (falls back to ATen's
//          choice where cuDNN cannot run the shapes). On H200 at 512K it runs at 548 TFLOP/s
//          against flash's 322.
// "auto": cudnn on CUDA tensors, math elsewhere.
// head_groups > 1 runs the KV heads in that many groups one after another (each with its
// query heads), so the attention kernels' working memory is that of one group; it must
// divide the model's num_key_value_heads (checked by the caller, which knows the model).
absl::StatusOr<std::shared_ptr<const AttentionBackend>> MakeAttentionBackend(const std::string& kind,
                                                                             int64_t head_groups = 1);

// Runs `inner` over `groups` groups of KV heads one after another (see MakeAttentionBackend).
std::shared_ptr<const AttentionBackend> WrapHeadGroups(std::shared_ptr<const AttentionBackend> inner, int64_t groups);

// The kernel ATen's SDPA dispatch picks for causal GQA attention on these shapes ("flash",
// "cudnn", "efficient", "math", ...), with cuDNN first in the order when cudnn_first. For logs.
std::string SdpaKernelFor(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, bool cudnn_first);

}  // namespace odyssey::model
