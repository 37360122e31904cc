// Job spec files for the `odyssey` CLI: YAML or JSON text mapped onto odyssey.v1.JobSpec.
//
// Field names are the proto's (snake_case; lowerCamelCase also accepted), enums by name
// ("SFT"). YAML scalars are passed to protobuf's JSON mapping as strings, which it converts to
// the field's type, so `lr: 1e-4`, `steps: 100` and `shard_params: true` all work. Errors name
// the file and the field ("tiny.yaml: optimizer.lrr: unknown field"). Only the shape is checked
// here; the controller validates the values. Thread safety: pure functions.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "odyssey/v1/odyssey.pb.h"

namespace odyssey::client {

// Parses `text` (JSON when it starts with '{', else YAML). `source` names it in errors.
absl::StatusOr<odyssey::v1::JobSpec> ParseJobSpec(const std::string& text, const std::string& source);
// Reads and parses a spec file.
absl::StatusOr<odyssey::v1::JobSpec> LoadJobSpec(const std::string& path);

}  // namespace odyssey::client
