// DeepSpeed-Ulysses context parallelism around attention, and its head-chunked ("untied",
// Together's UPipe) variant, as a kernels::AttentionBackend wrapper.
//
// The sequence of every row is sharded over the P ranks of a context-parallel group: rank r
// holds positions [r S/P, (r+1) S/P) of every layer's activations, and everything but attention
// is position-wise, so only attention needs the other ranks. Around it, an all-to-all trades
// the sequence split for a head split:
//
//     q (B, Hq, S/P, D)  --all-to-all-->  (B, Hq/P, S, D)   the rank's query heads, whole rows
//     k, v (B, Hkv, S/P, D)  -->  (B, Hkv'/P, S, D)          the KV heads those queries use
//     inner attention on whole rows (causal, documents) over the local heads
//     out (B, Hq/P, S, D)  --all-to-all-->  (B, Hq, S/P, D)
//
// GQA: query head h uses KV head h / (Hq / Hkv). With Hkv' = lcm(Hkv, P) (each KV head
// repeated Hkv' / Hkv times before the all-to-all; P | Hq and Hkv | Hq make lcm(Hkv, P) | Hq),
// rank r's contiguous block of Hq/P query heads uses exactly its block of Hkv'/P KV heads, so
// KV heads fewer than P are replicated and each rank gets the ones its queries read. Gradients
// of the repeats are summed back (autograd of repeat_interleave, or by hand in the chunked path).
//
// Head chunks (UPipe): with head_chunk G (P | G | Hq), the query heads go through the
// all-to-all, the attention and the way back in Hq/G rounds of G heads (with the KV heads they
// use), one after another, so the all-to-all buffers and the head-layout copies of q, k, v and
// the output are G/Hq of their full size. Where the inner backend has separate statistics and
// backward kernels (SupportsStats) and rows are not packed, one autograd Function runs the
// rounds: forward keeps only the sequence-sharded output and log-sum-exp (the inputs are
// alive anyway), and backward redoes the rounds (all-to-all of q, k, v, out, grad and lse of G
// heads, the inner backward, all-to-all of dq, dk, dv back into one set of gradient tensors),
// so no head-layout tensor outlives its round. Otherwise (packed rows, or an inner backend
// without statistics such as the kept-attention stash) each round is an ordinary autograd
// graph: the buffers of the all-to-all are still per round, but what the inner kernel saves for
// backward adds up over the rounds as in plain Ulysses. G = 0 or Hq is plain Ulysses.
//
// The wrapper must be the outermost backend (the model's): it overrides Forward so that packed
// rows are split into documents on whole rows, after the all-to-all. AttentionMeta::doc_lens
// are therefore the whole rows' documents (summing to S, not S/P). With P = 1 every all-to-all
// is the identity and the wrapper computes what the inner backend computes.
//
// Collectives run inside autograd (forward, recompute and backward alike): every rank of the
// group must run the same layers in the same order, which the training step guarantees. A
// failed collective throws (c10::Error naming the communicator's status); the group is then
// broken.
// Thread safety: no mutable state of its own; the communicator is used by one thread at a time
// (the rank's training thread, or autograd's device thread while it waits).
#pragma once

#include <memory>
#include <string>
#include <tuple>
#include <utility>

#include "absl/status/status.h"
#include "engine/parallel/communicator.h"
#include "kernels/attention.h"

namespace odyssey::engine {

// The autograd all-to-all: forward Communicator::AllToAll(x, split_dim, concat_dim), backward
// the inverse all-to-all of the gradient. Throws on a failed collective.
torch::Tensor DifferentiableAllToAll(Communicator& comm, const torch::Tensor& x, int64_t split_dim,
                                     int64_t concat_dim);

// Checks a context-parallel layout against the model: P divides the query heads, the head chunk
// G (0 = all heads at once) is a multiple of P dividing the query heads and compatible with
// GQA (a chunk holds whole KV-head groups, or lies inside one), and, when seq_len > 0, P
// divides the sequence. INVALID_ARGUMENT naming both numbers of the rule that failed.
absl::Status ValidateContextParallel(int64_t P, int64_t head_chunk, int64_t num_attention_heads,
                                     int64_t num_key_value_heads, int64_t seq_len);

class UlyssesAttention final : public kernels::AttentionBackend {
 public:
  // REQUIRES: `group` outlives the backend; ValidateContextParallel(group.world_size(),
  // head_chunk, ...) holds for the model (checked again per call with TORCH_CHECK).
  UlyssesAttention(std::shared_ptr<const kernels::AttentionBackend> inner, Communicator& group, int64_t head_chunk = 0);

  std::string name() const override;
  // q (B, Hq, S/P, D), k, v (B, Hkv, S/P, D): this rank's positions; meta.doc_lens are whole
  // rows' documents. Returns (B, Hq, S/P, D). Differentiable.
  torch::Tensor Forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const kernels::AttentionMeta& meta) const override;
  torch::Tensor Causal(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       double scale) const override;

  // The kept-attention pair over sharded rows, when the inner backend has it: the output and
  // lse come back sequence-sharded ((B, Hq, S/P, D) and (B, Hq, S/P) plus any trailing dims of
  // the inner kernel's lse); extra holds the inner kernel's extras round by round. The backward
  // redoes the all-to-alls (nothing head-layout is kept between the two). Runs in head chunks
  // as Forward does.
  bool SupportsStats(const torch::Device& device) const override { return inner_->SupportsStats(device); }
  std::pair<torch::Tensor, kernels::AttentionStats> CausalWithStats(const torch::Tensor& q, const torch::Tensor& k,
                                                                    const torch::Tensor& v,
                                                                    double scale) const override;
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> CausalBackward(
      const torch::Tensor& grad_out, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
      const torch::Tensor& out, const kernels::AttentionStats& stats, double scale) const override;

  // Query heads per round for Hq query heads (G, or Hq when G is 0).
  int64_t HeadsPerRound(int64_t Hq) const { return head_chunk_ > 0 ? head_chunk_ : Hq; }

 private:
  // The KV heads [kv0, kv0 + nkv) that query heads [h0, h0 + G) use.
  static std::pair<int64_t, int64_t> KvRange(int64_t h0, int64_t G, int64_t Hq, int64_t Hkv);
  void CheckShapes(const torch::Tensor& q, const torch::Tensor& k) const;

  std::shared_ptr<const kernels::AttentionBackend> inner_;
  Communicator& group_;
  const int64_t head_chunk_;
};

}  // namespace odyssey::engine
