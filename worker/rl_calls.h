// Conversions between the worker protocol's TrainingCall / TrainingReply (odyssey.v1) and the
// plain structs RlSession takes (rl_session.h; the batch as engine::Datum, engine/rl_datum.h):
// the protobuf side of the libtorch/protobuf seam. Nothing is validated here: the engine does it
// once (Trainer::ValidateRl), with messages naming field, datum index and rule.
// Pure functions; thread-safe.
#pragma once

#include "odyssey/v1/odyssey.pb.h"
#include "worker/rl_session.h"

namespace odyssey::worker {

// The call's request as an RlRequest (token ids widened to int64; proto defaults left as 0; the
// controller's shard fields weight_sum and datum_offset carried over).
// REQUIRES: call.call_case() is set.
RlRequest ToRlRequest(const odyssey::v1::TrainingCall& call);

// The reply to `call`: its call_id and job, the status code and message unchanged, and on
// success the response message of the call's method.
odyssey::v1::TrainingReply ToTrainingReply(const odyssey::v1::TrainingCall& call, RlResponse&& response);

// A reply to `call` carrying only an error.
odyssey::v1::TrainingReply ErrorReply(const odyssey::v1::TrainingCall& call, const absl::Status& status);

// Appends phase times (spec.profile.phase_times; engine/profiler.h) to `out` in their order,
// for an SFT step's StepMetrics and an RL call's reply alike.
void AddPhases(const std::vector<engine::PhaseTime>& phases,
               google::protobuf::RepeatedPtrField<odyssey::v1::PhaseSeconds>* out);

// "forward_backward", "optim_step", ... for logs.
const char* CallName(const odyssey::v1::TrainingCall& call);

}  // namespace odyssey::worker
