#include "server/rl_batch.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace odyssey::server {

namespace v1 = odyssey::v1;

namespace {

int64_t Positions(const google::protobuf::RepeatedPtrField<v1::Datum>& batch) {
  int64_t n = 0;
  for (const v1::Datum& d : batch) n += d.tokens_size();
  return n;
}

// W of a batch: the sum of its weights, a datum without weights counting 1 per token
// (engine/rl_loss.h BatchWeightSum on the whole batch).
double WeightSum(const google::protobuf::RepeatedPtrField<v1::Datum>& batch) {
  double w = 0;
  for (const v1::Datum& d : batch) {
    if (d.weights_size() == 0) {
      w += static_cast<double>(d.tokens_size());
    } else {
      for (float x : d.weights()) w += x;
    }
  }
  return w;
}

// The engine's errors on the ranks whose own slice was fine, when another rank's was not or
// failed ("batch: refused on another rank ...", "forward_backward failed on another rank ...").
bool IsAnotherRanksEcho(const v1::TrainingReply& reply) {
  return absl::StrContains(reply.message(), "on another rank");
}

// The error of a multi-rank call that failed on some rank: the first non-OK reply in rank order
// that names its own cause; the first echo of another rank's failure when every error is one.
const v1::TrainingReply* FirstError(const std::vector<v1::TrainingReply>& replies) {
  const v1::TrainingReply* echo = nullptr;
  for (const v1::TrainingReply& r : replies) {
    if (r.code() == 0) continue;
    if (!IsAnotherRanksEcho(r)) return &r;
    if (!echo) echo = &r;
  }
  return echo;
}

// One reply out of the ranks' forward_backward replies (all OK). weight_sum: the W every rank
// normalized by (the whole batch's; the same on every rank).
v1::TrainingReply MergeForwardBackward(const std::vector<v1::TrainingReply>& replies) {
  v1::TrainingReply out;
  out.set_call_id(replies[0].call_id());
  out.set_job(replies[0].job());
  v1::ForwardBackwardResponse* fb = out.mutable_forward_backward();
  double mismatch_sum = 0;  // sum over ranks of mean x tokens
  for (const v1::TrainingReply& r : replies) {
    const v1::ForwardBackwardResponse& p = r.forward_backward();
    for (const v1::TokenLogprobs& l : p.logprobs()) *fb->add_logprobs() = l;
    fb->set_loss(fb->loss() + p.loss());  // each rank's share is already normalized by W
    mismatch_sum += p.mismatch_mean() * static_cast<double>(p.mismatch_tokens());
    fb->set_mismatch_tokens(fb->mismatch_tokens() + p.mismatch_tokens());
    fb->set_mismatch_max(std::max(fb->mismatch_max(), p.mismatch_max()));
    fb->set_clipped_tokens(fb->clipped_tokens() + p.clipped_tokens());
    fb->set_tokens(fb->tokens() + p.tokens());
    fb->set_seconds(std::max(fb->seconds(), p.seconds()));  // the ranks run side by side
  }
  fb->set_weight_sum(replies[0].forward_backward().weight_sum());
  *fb->mutable_phases() = replies[0].forward_backward().phases();  // rank 0 times the call
  if (fb->mismatch_tokens() > 0) fb->set_mismatch_mean(mismatch_sum / static_cast<double>(fb->mismatch_tokens()));
  return out;
}

}  // namespace

std::vector<std::pair<int, int>> SplitBatch(const google::protobuf::RepeatedPtrField<v1::Datum>& batch, int ranks) {
  const int n = batch.size();
  std::vector<int64_t> prefix(static_cast<size_t>(n) + 1, 0);  // prefix[i]: tokens of datums [0, i)
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + batch[i].tokens_size();
  const double total = static_cast<double>(prefix[n]);
  std::vector<std::pair<int, int>> out;
  int begin = 0;
  for (int r = 1; r <= ranks; ++r) {
    int end = n;
    if (r < ranks) {
      // The first cut in [begin, n] at or past the target, or the one before it when that is
      // strictly nearer: ties go to the later cut, so empty ranges fall on the last ranks.
      const double target = total * r / ranks;
      end = begin;
      while (end < n && static_cast<double>(prefix[end]) < target) ++end;
      if (end > begin && target - static_cast<double>(prefix[end - 1]) < static_cast<double>(prefix[end]) - target)
        --end;
    }
    out.emplace_back(begin, end);
    begin = end;
  }
  return out;
}

int64_t BatchPositions(const v1::TrainingCall& call) {
  const google::protobuf::RepeatedPtrField<v1::Datum>* batch = nullptr;
  if (call.has_forward_backward()) batch = &call.forward_backward().batch();
  if (call.has_forward()) batch = &call.forward().batch();
  if (!batch) return 0;
  return Positions(*batch);
}

int64_t RankPositionLimit(const v1::JobSpec& spec) {
  return spec.data().seq_len() * std::max<int64_t>(1, spec.data().batch_size());
}

int ContextParallelDegree(const v1::JobSpec& spec) { return std::max(1, spec.parallel().context_parallel()); }

absl::StatusOr<std::vector<RankCall>> SplitCall(v1::TrainingCall call, int world, const v1::JobSpec& spec) {
  const int64_t limit = RankPositionLimit(spec);
  // The batch is split between D = world / P data-parallel units; a unit is one rank, or a
  // context-parallel group of P consecutive ranks that all get the unit's slice (each runs its
  // positions of every datum: seq_len x batch_size bounds the slice, the planner having checked
  // seq_len / P positions per rank).
  const int P = ContextParallelDegree(spec);
  const int D = std::max(1, world / P);
  const std::string limit_why =
      absl::StrCat("spec.data.seq_len ", spec.data().seq_len(), " x spec.data.batch_size ",
                   std::max<int64_t>(1, spec.data().batch_size()),
                   P > 1 ? absl::StrCat(", the memory the planner checked, spread over parallel.context_parallel ", P,
                                        " ranks")
                         : std::string(", the memory the planner checked per rank"));
  std::vector<RankCall> targets;
  if (call.has_forward_backward() || call.has_forward()) {
    google::protobuf::RepeatedPtrField<v1::Datum> batch;
    batch.Swap(call.has_forward_backward() ? call.mutable_forward_backward()->mutable_batch()
                                           : call.mutable_forward()->mutable_batch());
    const int64_t positions = Positions(batch);
    if (positions > limit * D) {
      return absl::InvalidArgumentError(absl::StrCat(
          "batch: ", positions, " token positions exceed the session's limit of ", limit * D, " (",
          D > 1 ? absl::StrCat(D, P > 1 ? " context-parallel groups x " : " ranks x ", limit, ": ") : "", limit_why,
          "); split the batch"));
    }
    // A W that is not a positive finite number (a NaN or infinite weight, all weights 0) is not
    // sent: the engine then sums the slices' weights itself, and its validation names the bad
    // datum, or refuses a weightless batch, as on one rank.
    double weight_sum = 0;
    if (call.has_forward_backward()) {
      weight_sum = WeightSum(batch);
      if (!(std::isfinite(weight_sum) && weight_sum > 0)) weight_sum = 0;
    }
    const std::vector<std::pair<int, int>> ranges = SplitBatch(batch, D);
    for (int u = 0; u < D; ++u) {
      const auto [begin, end] = ranges[static_cast<size_t>(u)];
      int64_t slice = 0;
      for (int i = begin; i < end; ++i) slice += batch[i].tokens_size();
      if (slice > limit) {
        return absl::InvalidArgumentError(absl::StrCat(
            "batch: ", P > 1 ? absl::StrCat("context-parallel group ", u, " (ranks ", u * P, "..", u * P + P - 1, ")")
                             : absl::StrCat("rank ", u),
            "'s slice (batch[", begin, "..", end - 1, "]) holds ", slice, " token positions, over the per-",
            P > 1 ? "group" : "rank", " limit of ", limit, " (", limit_why, "); the batch is split between the session's ",
            D, P > 1 ? " context-parallel groups" : " ranks",
            " in datum order, balanced by tokens: split the batch or shorten its longest datums"));
      }
      v1::TrainingCall rc = call;  // the call without its batch
      google::protobuf::RepeatedPtrField<v1::Datum>* out =
          rc.has_forward_backward() ? rc.mutable_forward_backward()->mutable_batch() : rc.mutable_forward()->mutable_batch();
      out->Reserve(end - begin);
      for (int i = begin; i < end; ++i) *out->Add() = batch[i];
      rc.set_datum_offset(begin);
      if (rc.has_forward_backward()) rc.set_weight_sum(weight_sum);
      for (int r = u * P; r < u * P + P; ++r) targets.push_back({r, rc});
    }
  } else if (call.has_optim_step() || call.has_load_checkpoint()) {
    // The engine's OptimStep all-reduces the gradients; LoadCheckpoint must reach every rank's
    // copy of the weights and optimizer state.
    for (int r = 0; r < world; ++r) targets.push_back({r, call});
  } else {
    // save_checkpoint, export_weights, sample: the ranks' weights are identical; rank 0 writes
    // (samples).
    targets.push_back({0, std::move(call)});
  }
  return targets;
}

absl::StatusOr<v1::TrainingReply> MergeReplies(v1::TrainingCall::CallCase kind, int context_parallel,
                                               std::vector<v1::TrainingReply> replies) {
  if (const v1::TrainingReply* error = FirstError(replies)) {
    return absl::Status(static_cast<absl::StatusCode>(error->code()), error->message());
  }
  const bool split = kind == v1::TrainingCall::kForwardBackward || kind == v1::TrainingCall::kForward;
  if (split && context_parallel > 1) {
    // A context-parallel group's ranks each answer for the group's whole slice (the same
    // logprobs, loss and counts): the group's first rank's reply is the group's.
    std::vector<v1::TrainingReply> groups;
    for (size_t r = 0; r < replies.size(); r += static_cast<size_t>(context_parallel))
      groups.push_back(std::move(replies[r]));
    replies = std::move(groups);
  }
  if (replies.size() == 1 || !split) {
    return std::move(replies[0]);  // rank 0's: the same step, grad_norm, ... on every rank
  }
  if (replies[0].has_forward_backward()) return MergeForwardBackward(replies);
  v1::TrainingReply merged = std::move(replies[0]);
  v1::ForwardResponse* f = merged.mutable_forward();
  for (size_t r = 1; r < replies.size(); ++r) {
    for (v1::TokenLogprobs& l : *replies[r].mutable_forward()->mutable_logprobs()) *f->add_logprobs() = std::move(l);
  }
  return merged;
}

}  // namespace odyssey::server
