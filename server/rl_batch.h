// The RL batch split and merge of a data-parallel session (TrainingService, N > 1 ranks): how
// one TrainingCall becomes one call per rank, and how the ranks' replies become the caller's
// reply (server/README.md "Multi-rank sessions"). Pure functions over protos: no state, no
// locking; the Controller's session router (session_router.cc) forwards the calls and waits.
//
// - forward_backward and forward: N contiguous datum ranges balanced by token count
//   (SplitBatch); each rank gets its slice and the slice's whole-batch datum offset, and for
//   forward_backward W of the whole batch. Every rank gets a call, an empty slice included (it
//   still joins the engine's collectives).
// - optim_step and load_checkpoint: every rank (the engine all-reduces the gradients; a load
//   must reach every rank's weights and optimizer state).
// - save_checkpoint, export_weights and sample: rank 0 only (the ranks' weights are identical).
// - Replies: forward_backward merged (logprobs in datum order, loss summed, weight_sum = W,
//   mismatch token-weighted, counts summed, seconds the slowest rank's), forward's logprobs
//   concatenated, other calls rank 0's; a failure is the most specific rank's error.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "odyssey/v1/odyssey.pb.h"

namespace odyssey::server {

// The ranges [begin, end) of datums that the ranks of an N-rank session run: N contiguous
// ranges in datum order, cut where the running token count comes nearest to k/N of the batch's
// tokens (ties: the later cut, so that empty ranges fall on the last ranks). A range may be
// empty (fewer datums than ranks, or one long datum). REQUIRES: ranks >= 1.
std::vector<std::pair<int, int>> SplitBatch(const google::protobuf::RepeatedPtrField<odyssey::v1::Datum>& batch,
                                            int ranks);

// Token positions a call's batch runs (0 for calls without a batch).
int64_t BatchPositions(const odyssey::v1::TrainingCall& call);

// The token positions one rank of a session of `spec` may run in one call: spec.data.seq_len x
// spec.data.batch_size (batch_size 0 counting 1), the memory the planner checked.
int64_t RankPositionLimit(const odyssey::v1::JobSpec& spec);

// One rank's part of a multi-rank call.
struct RankCall {
  int rank = 0;
  odyssey::v1::TrainingCall call;  // call_id and job not set (the router's)
};

// P, the session's context-parallel degree (spec.parallel.context_parallel; 0 counts 1), which
// validation keeps dividing the world size: the session's ranks are world / P data-parallel
// units, each a context-parallel group of P consecutive ranks that all get the unit's slice of a
// forward_backward or forward and each answer for all of it.
int ContextParallelDegree(const odyssey::v1::JobSpec& spec);

// The calls the ranks of a `world`-rank session of `spec` get for `call` (rank order), as above,
// with the batch split between world / P units (every rank of a context-parallel group gets its
// group's slice; the limits are per unit).
// INVALID_ARGUMENT (naming `batch` and the limit) when the batch holds more than world x
// RankPositionLimit(spec) positions, or one rank's slice more than RankPositionLimit(spec).
// REQUIRES: world >= 1; `call` has none of the shard fields (weight_sum, datum_offset) set.
absl::StatusOr<std::vector<RankCall>> SplitCall(odyssey::v1::TrainingCall call, int world,
                                                const odyssey::v1::JobSpec& spec);

// The caller's reply out of `replies` (one per RankCall of SplitCall, in its order) to a call of
// kind `kind`: the merge above when every reply is OK, over the first rank of each
// context-parallel group of `context_parallel` ranks (ContextParallelDegree of the spec); else the status of the first failed reply
// in rank order that names its own cause, skipping the engine's echoes of another rank's failure
// ("... on another rank ..."); the first echo when every error is one. REQUIRES: replies is not
// empty.
absl::StatusOr<odyssey::v1::TrainingReply> MergeReplies(odyssey::v1::TrainingCall::CallCase kind,
                                                        int context_parallel,
                                                        std::vector<odyssey::v1::TrainingReply> replies);

}  // namespace odyssey::server
