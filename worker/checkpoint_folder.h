// Checkpoint folders and who owns them: the rules by which a job writes and prunes only its own
// step folders (worker/README.md "Checkpoint folders"). No libtorch, no protobuf: the SFT run
// (engine_job.cc) and RL sessions (rl_session.cc) both use it, and its test is torch-free.
//
// A job's checkpoint folder holds step folders <dir>/step-NNNNNNNN. Each step folder carries an
// owner file, .odyssey-owner, holding its owner: "<store id>/jobs/N" (Assignment.checkpoint_owner,
// unique across controller stores, so a job 1 of a new store is not the job 1 of an old one).
// It is written into the staging folder before the rename, so a published step folder always
// names its owner. The rules:
// - A job starts writing in a folder only when every step folder there is its own
//   (CheckCheckpointFolder): a folder with another owner's step folders, or with step folders
//   without an owner file (written by an older odyssey or by hand), is refused with
//   FAILED_PRECONDITION naming the folder and the step, before the job trains. A restart of the
//   same job finds its own steps and continues.
// - Keep-K pruning counts and removes only the job's own step folders (PruneCheckpoints).
// - A step folder of another owner is never replaced (CheckReplaceable), even when one appears
//   after the start check (two controllers' jobs sharing a folder).
// - Staging leftovers of a run that died mid-write are removed only when they are the job's own
//   or name no owner (RemoveStagingLeftovers): another live job's staging folder stays.
// - Reading is never restricted: any job may resume from or load any checkpoint.
//
// Thread safety: free functions; concurrent writers of one folder are the rules' subject.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/files.h"

namespace odyssey::worker {

// The owner file's name inside a step (or save/export) folder.
inline constexpr char kOwnerFile[] = ".odyssey-owner";

// "<dir>/step-%08d".
std::string CheckpointPath(const std::string& dir, int64_t step);
// Checkpoint folders in `dir` named step-NNNNNNNN, oldest first (every owner's).
std::vector<std::string> ListCheckpoints(const std::string& dir);

// The owner `folder`'s owner file names; "" when it has none (or it cannot be read).
std::string ReadOwner(const std::string& folder);
// Writes `owner` into `folder`/.odyssey-owner (atomically). REQUIRES: `folder` exists.
absl::Status WriteOwner(const std::string& folder, const std::string& owner);

// OK when `owner` may write step folders into `dir`: it does not exist, or every step folder in
// it is `owner`'s. Else FAILED_PRECONDITION: "<field>: checkpoint folder "<dir>" holds step-N of
// another job ..." saying what to do. REQUIRES: owner is not empty.
absl::Status CheckCheckpointFolder(const std::string& dir, const std::string& owner, absl::string_view field);

// OK when `owner` may replace `folder`: it does not exist, is empty, or is `owner`'s. Else
// FAILED_PRECONDITION naming `field` and the folder.
absl::Status CheckReplaceable(const std::string& folder, const std::string& owner, absl::string_view field);

// Removes `owner`'s oldest step folders in `dir` until `keep` of its own remain (keep <= 0:
// none removed). Other owners' step folders are neither removed nor counted. Each goes out of
// the step folders' names first (renamed to ".step-NNNNNNNN.pruned", a leftover that
// RemoveStagingLeftovers clears) and is then removed by `remove` (default: std::filesystem::
// remove_all; tests interrupt it): a run killed while a removal is half done leaves no step
// folder without its owner file behind, which the job's restart would refuse (the soak's kill -9
// failed a job so). A step folder that cannot be renamed stays whole, for the next prune.
void PruneCheckpoints(const std::string& dir, const std::string& owner, int keep,
                      const std::function<void(const std::string&)>& remove = {});

// The checkpoint a restarted run of `owner` resumes from, given `recorded`, the one the controller
// last heard of: the newest of `owner`'s step folders in `dir` when it is at least as new as
// `recorded` (a run the controller lost may have gone on writing, and pruning keep-K, past what it
// reported: `recorded` may be gone), else `recorded`. A `recorded` that is not a step folder
// (step-NNNNNNNN) counts as older than any step folder only when it no longer exists.
std::string RestartCheckpoint(const std::string& dir, const std::string& owner, const std::string& recorded);

// Removes the staging folders (".step-*") in `dir` that a run of `owner` left when it died
// mid-write, and those that name no owner and were last modified over kOwnerlessStagingAge ago
// (an older odyssey's; a live job's folder names no owner for a moment after its creation).
inline constexpr std::chrono::minutes kOwnerlessStagingAge{10};
void RemoveStagingLeftovers(const std::string& dir, const std::string& owner);

// Publishes `staged` (StagedFolder::Publish) when its owner file still names `owner`. A run the
// controller gave up on (its worker stopped or cut off mid-write) can come back and finish a
// checkpoint after a newer run of the same job removed that staging folder as a dead run's
// leftover (RemoveStagingLeftovers): what it wrote since has no owner file, and published it
// would sit in the checkpoint folder as nobody's, which the newer run must then refuse to
// replace. Such a folder is not published: ABORTED naming `field` and the folder (the staging
// folder is removed with `staged`).
absl::Status PublishOwned(StagedFolder& staged, const std::string& owner, absl::string_view field);

}  // namespace odyssey::worker
