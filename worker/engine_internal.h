// Engine-side helpers shared by the SFT run (engine_job.cc) and RL sessions (rl_session.cc).
// Includes libtorch: only for translation units of odyssey_worker_engine (see engine_job.h for
// why libtorch and protobuf never share a translation unit).
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/trainer.h"
#include "worker/engine_job.h"

namespace odyssey::worker {

// The trainer's options for job `j`, the same for SFT runs and RL sessions: model, device,
// dtype, optimizer, schedule, memory strategy (the planner's choice on a GPU for what the spec
// leaves unset), data. No communicator.
absl::Status BuildTrainerOptions(const EngineJobOptions& j, engine::TrainerOptions* out);

// Writes `trainer`'s checkpoint for its current step to <dir>/step-NNNNNNNN atomically (a
// common/files.h StagedFolder: hidden staging folder, fsynced, renamed) with `owner` in its
// owner file, and prunes `owner`'s step folders to the newest `keep` (0 = all; checkpoint_folder.h).
// FAILED_PRECONDITION when that step folder exists and is another owner's. Returns the path.
absl::StatusOr<std::string> WriteCheckpoint(engine::Trainer& trainer, const std::string& dir, int keep,
                                            const std::string& owner);

}  // namespace odyssey::worker
