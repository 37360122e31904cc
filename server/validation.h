// Request validation for the controller: every rule a JobSpec or a request must satisfy.
//
// Each failure is an absl::Status whose message names the field (by its proto path, e.g.
// "spec.optimizer.lr") and the rule that failed, with the code the API promises:
// INVALID_ARGUMENT for malformed input, UNIMPLEMENTED for kinds not served yet. Functions are
// pure (they read the filesystem only to check that model and dataset paths are readable) and
// thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "odyssey/v1/odyssey.pb.h"

namespace odyssey::server {

// Longest display_name accepted, in bytes.
inline constexpr size_t kMaxDisplayNameBytes = 256;
// Largest world_size a job may ask for.
inline constexpr int32_t kMaxWorldSize = 4096;
// Page size bounds of ListJobs (0 = kDefaultPageSize).
inline constexpr int32_t kDefaultPageSize = 50;
inline constexpr int32_t kMaxPageSize = 1000;

// Checks a JobSpec; `field` prefixes field names in messages ("spec").
// Resolves the model (a named shape or a checkpoint directory with config.json) to check
// seq_len against max_position_embeddings, and checks the dataset path is a readable file.
absl::Status ValidateJobSpec(const odyssey::v1::JobSpec& spec, absl::string_view field = "spec");

absl::Status ValidateCreateJobRequest(const odyssey::v1::CreateJobRequest& request);
absl::Status ValidateListJobsRequest(const odyssey::v1::ListJobsRequest& request);

// "jobs/{id}" with id a positive decimal number. `field` names the field in messages.
absl::StatusOr<int64_t> ParseJobName(absl::string_view name, absl::string_view field = "name");
std::string JobName(int64_t id);

}  // namespace odyssey::server
