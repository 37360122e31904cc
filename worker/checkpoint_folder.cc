#include "worker/checkpoint_folder.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "common/files.h"
#include "common/log.h"

namespace odyssey::worker {
namespace fs = std::filesystem;

std::string CheckpointPath(const std::string& dir, int64_t step) {
  return (fs::path(dir) / absl::StrFormat("step-%08d", step)).string();
}

std::vector<std::string> ListCheckpoints(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (e.is_directory() && name.size() == 13 && absl::StartsWith(name, "step-") &&
        name.find_first_not_of("0123456789", 5) == std::string::npos)
      out.push_back(e.path().string());
  }
  std::sort(out.begin(), out.end());  // zero-padded: lexicographic = numeric
  return out;
}

std::string RestartCheckpoint(const std::string& dir, const std::string& owner, const std::string& recorded) {
  std::string newest;
  for (const std::string& path : ListCheckpoints(dir))
    if (ReadOwner(path) == owner) newest = path;  // oldest first: the last one is the newest
  if (newest.empty() || newest == recorded) return recorded;
  std::error_code ec;
  if (!fs::exists(recorded, ec)) return newest;
  // Both exist: the newer by step number (a recorded folder of another name stays).
  const std::string name = fs::path(recorded).filename().string();
  int64_t step = 0;
  if (!(name.size() == 13 && absl::StartsWith(name, "step-") && absl::SimpleAtoi(name.substr(5), &step))) {
    return recorded;
  }
  int64_t newest_step = 0;
  if (!absl::SimpleAtoi(fs::path(newest).filename().string().substr(5), &newest_step)) return recorded;
  return newest_step >= step ? newest : recorded;
}

std::string ReadOwner(const std::string& folder) {
  std::ifstream in(fs::path(folder) / kOwnerFile, std::ios::binary);
  if (!in) return "";
  std::stringstream contents;
  contents << in.rdbuf();
  return std::string(absl::StripAsciiWhitespace(contents.str()));
}

absl::Status WriteOwner(const std::string& folder, const std::string& owner) {
  return WriteFileAtomically((fs::path(folder) / kOwnerFile).string(), absl::StrCat(owner, "\n"));
}

absl::Status CheckCheckpointFolder(const std::string& dir, const std::string& owner, absl::string_view field) {
  for (const std::string& step : ListCheckpoints(dir)) {
    const std::string found = ReadOwner(step);
    if (found == owner) continue;
    // The owner goes to the worker's log only: the job's error must not name another tenant's job.
    LogWarning(absl::StrCat("checkpoint folder ", dir, " refused to ", owner, ": ", step, " belongs to ",
                            found.empty() ? "no one (no owner file)" : found));
    return absl::FailedPreconditionError(absl::StrCat(
        field, ": checkpoint folder \"", dir, "\" holds ", fs::path(step).filename().string(),
        found.empty() ? " without an owner file (written by an older odyssey or by hand)" : " of another job",
        "; a job writes only into a folder without step folders or with its own, and never prunes or replaces "
        "another's: choose a new checkpoint.directory, or move those step folders away (any job may still read "
        "them, e.g. as resume_from or a model path)"));
  }
  return absl::OkStatus();
}

absl::Status CheckReplaceable(const std::string& folder, const std::string& owner, absl::string_view field) {
  std::error_code ec;
  if (!fs::exists(folder, ec) || (fs::is_directory(folder, ec) && fs::is_empty(folder, ec))) return absl::OkStatus();
  if (fs::is_directory(folder, ec) && ReadOwner(folder) == owner) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat(field, ": \"", folder, "\" exists and is not this job's checkpoint or export (another job's, or "
                   "not written by odyssey); it is left as it is: choose a new folder"));
}

void PruneCheckpoints(const std::string& dir, const std::string& owner, int keep,
                      const std::function<void(const std::string&)>& remove) {
  if (keep <= 0) return;
  std::vector<std::string> own;
  for (const std::string& step : ListCheckpoints(dir))
    if (ReadOwner(step) == owner) own.push_back(step);
  std::error_code ec;
  for (size_t i = 0; i + static_cast<size_t>(keep) < own.size(); ++i) {
    const fs::path from(own[i]);
    const fs::path to = from.parent_path() / absl::StrCat(".", from.filename().string(), ".pruned");
    fs::remove_all(to, ec);  // an earlier prune's interrupted leftover of the same step
    ec.clear();
    fs::rename(from, to, ec);
    if (ec) continue;
    if (remove) {
      remove(to.string());
    } else {
      fs::remove_all(to, ec);
    }
  }
}

void RemoveStagingLeftovers(const std::string& dir, const std::string& owner) {
  std::error_code ec;
  std::vector<fs::path> leftovers;
  const auto now = fs::file_time_type::clock::now();
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (!absl::StartsWith(e.path().filename().string(), ".step-")) continue;
    const std::string found = ReadOwner(e.path().string());
    if (found == owner) {
      leftovers.push_back(e.path());
    } else if (found.empty()) {
      // An older odyssey's leftover only when it is old: a live job's staging folder has no
      // owner file for the moment between its creation and its owner file.
      std::error_code mtime_ec;
      const auto modified = fs::last_write_time(e.path(), mtime_ec);
      const bool old = !mtime_ec && now - modified > kOwnerlessStagingAge;
      if (old) leftovers.push_back(e.path());
    }
  }
  for (const fs::path& p : leftovers) fs::remove_all(p, ec);
}

absl::Status PublishOwned(StagedFolder& staged, const std::string& owner, absl::string_view field) {
  if (ReadOwner(staged.path()) != owner) {
    return absl::AbortedError(absl::StrCat(field, ": \"", staged.target(),
                                           "\" not published: its staging folder lost its owner file while this run "
                                           "wrote it (a newer run of this job removed it as a dead run's leftover)"));
  }
  return staged.Publish();
}

}  // namespace odyssey::worker
