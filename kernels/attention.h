// Dense causal attention: the one interface every attention layer calls, and its backends
// (ATen SDPA, cuDNN first in SDPA's order, an explicit fp32-softmax "math" path, KV-head
// groups run one after another). model/ calls it; engine/memory/ wraps a backend to keep the
// attention output from the first forward (its recompute then runs only CausalBackward).
//
// Shapes: q (B, Hq, S, D), k and v (B, Hkv, S, D) with Hkv dividing Hq (GQA: query head h uses
// KV head h / (Hq / Hkv)); the output has q's shape and dtype. Attention is causal (query i
// sees keys 0..i); with packed rows (AttentionMeta::doc_lens) it is causal within each
// document and never crosses a document boundary.
// Thread safety: backends hold no mutable state and may be shared. The cudnn backend sets
// ATen's process-global SDPA priority order around each call (one training thread per process).
#pragma once

#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "absl/status/statusor.h"

namespace odyssey::kernels {

struct AttentionMeta {
  // Per row of the batch, the lengths of packed documents (summing to S); null or a row with
  // at most one entry = the whole row is one document.
  const std::vector<std::vector<int64_t>>* doc_lens = nullptr;
  double scale = 0.0;  // softmax scale; 0 = 1/sqrt(D)
};

// What a kernel's backward needs besides q, k, v and the output: the softmax log-sum-exp
// lse (B, Hq, S) fp32 (natural log of the sum over keys of exp(scale * q.k)), and
// kernel-specific extras (cuDNN: cumulative sequence lengths, RNG seed and offset).
struct AttentionStats {
  torch::Tensor lse;  // (B, Hq, S) fp32; the cuDNN kernels keep it as (B, Hq, S, 1)
  std::vector<torch::Tensor> extra;
  int64_t max_q = 0, max_k = 0;
};

class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;
  virtual std::string name() const = 0;

  // Splits packed rows into documents and runs Causal() on each. Differentiable (autograd
  // through the backend's kernels). Virtual for wrappers that must see whole rows before the
  // split: context parallelism (engine/parallel/ulysses.h) gets sequence shards and splits the
  // documents only after its all-to-all has assembled whole rows.
  // REQUIRES: shapes as in the file comment; meta.doc_lens, when set, has one entry per row of
  // the batch and each row's lengths sum to S.
  virtual torch::Tensor Forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const AttentionMeta& meta) const;  // (B, Hq, S, D)

  // Plain causal attention over whole rows: softmax(scale * q k^T + causal mask) v.
  // REQUIRES: shapes as in the file comment; scale > 0.
  virtual torch::Tensor Causal(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               double scale) const = 0;  // (B, Hq, S, D)

  // The forward with its statistics, and the backward kernel alone: a strategy that keeps a
  // layer's attention output from the first forward runs only the backward during the layer's
  // recompute. Backends without them report SupportsStats() false for q, k, v on `device`.
  virtual bool SupportsStats(const torch::Device& device) const { return false; }
  // Returns the output (B, Hq, S, D) and its statistics. The kept-attention path runs it
  // without grad and takes the gradient from CausalBackward.
  // REQUIRES: SupportsStats(q.device()); shapes as in the file comment; scale > 0.
  virtual std::pair<torch::Tensor, AttentionStats> CausalWithStats(const torch::Tensor& q, const torch::Tensor& k,
                                                                   const torch::Tensor& v, double scale) const;
  // Returns (dq, dk, dv), shaped as q, k, v, for grad_out (B, Hq, S, D) of `out`.
  // REQUIRES: out and stats come from this backend's CausalWithStats(q, k, v, scale).
  virtual std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> CausalBackward(
      const torch::Tensor& grad_out, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
      const torch::Tensor& out, const AttentionStats& stats, double scale) const;
};

// "math": explicit matmul + softmax in fp32 (any device; the CPU reference path). Has stats.
// "sdpa": ATen scaled_dot_product_attention with ATen's own choice of kernel. No stats.
// "cudnn": ATen SDPA with the cuDNN kernel first in the priority order (falls back to ATen's
//          choice where cuDNN cannot run the shapes). On H200 at 512K it runs at 548 TFLOP/s
//          against flash's 322. Has stats on CUDA (the cuDNN kernels called directly).
// "auto" (or ""): cudnn on CUDA tensors, math elsewhere. Has stats.
// head_groups > 1 runs the KV heads in that many groups one after another (each with its
// query heads), so the attention kernels' working memory is that of one group; it must
// divide the model's num_key_value_heads (checked by the caller, which knows the model).
// The head-grouped backend reports no stats: wrap a stats-keeping backend in groups instead.
// Errors: INVALID_ARGUMENT naming the unknown kind, or head_groups < 1.
absl::StatusOr<std::shared_ptr<const AttentionBackend>> MakeAttentionBackend(const std::string& kind,
                                                                             int64_t head_groups = 1);

// Runs `inner` over `groups` groups of KV heads one after another (see MakeAttentionBackend);
// groups <= 1 returns inner itself.
std::shared_ptr<const AttentionBackend> WrapHeadGroups(std::shared_ptr<const AttentionBackend> inner, int64_t groups);

// The kernel ATen's SDPA dispatch picks for causal GQA attention on these shapes ("flash",
// "cudnn", "efficient", "math", ...), with cuDNN first in the order when cudnn_first. For logs.
std::string SdpaKernelFor(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, bool cudnn_first);

// The cudnn backend's kept-attention kernels (CausalWithStats / CausalBackward) take K/V with
// their own KV heads (false, the default: cuDNN's grouped-query support) or expanded to one head
// per query head by repeat_interleave, their gradients summed back (true: the older path, kept
// for side-by-side benchmarks, odyssey-bench --cudnn-expand-kv). Process-global.
void SetCudnnExpandKv(bool expand);

}  // namespace odyssey::kernels
