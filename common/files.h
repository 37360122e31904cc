// Atomic writes of files and folders: the one way every component persists something that a
// reader, or the next process after a crash, must see whole (port files, the KJV cache,
// safetensors, trainer state, checkpoint and export folders). No libtorch, no gRPC.
//
// A file is written into a temporary file in its own folder (a rename cannot cross file
// systems), fsynced, renamed over the target, and the folder is fsynced: readers see the old
// file or the whole new one, never a prefix, and so does the next reader after a crash.
// A folder is built in a staging folder beside the target that the caller fills; Publish()
// fsyncs what is in it and the staging folder itself, renames it onto the target (replacing an
// existing one; atomically where the file system can exchange two names) and fsyncs the parent.
//
// Temporary names carry the pid and a per-process counter ("<path>.tmp.<pid>.<n>" for files,
// ".<name>.tmp-<pid>.<n>" beside a folder), so concurrent writers of one target, threads or
// processes, never share a temporary; they race on the rename and the last one wins.
//
// Errors name the target, the operation that failed and the temporary involved, with the
// code errno maps to (absl::ErrnoToStatus: PERMISSION_DENIED, NOT_FOUND, RESOURCE_EXHAUSTED for
// a full disk, ...). A failure before the rename leaves the target as it was and removes the
// temporary; a failed fsync of the parent after the rename is reported although the new
// contents are already in place (they may not survive a machine crash).
//
// Thread safety: free functions and a single-owner class; any thread may write any path.
#pragma once

#include <cstddef>
#include <string>
#include <utility>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace odyssey {

// The temporary file a streaming WriteFileAtomically fills. Only the callback holds one.
class FileSink {
 public:
  FileSink(const FileSink&) = delete;
  FileSink& operator=(const FileSink&) = delete;

  // Appends `size` bytes (all of them: short writes and EINTR are retried).
  absl::Status Append(const void* data, size_t size);
  absl::Status Append(absl::string_view data) { return Append(data.data(), data.size()); }

  // The temporary file being written, for messages.
  const std::string& temp_path() const { return temp_path_; }

 private:
  friend absl::Status WriteFileAtomically(const std::string& path,
                                          absl::FunctionRef<absl::Status(FileSink&)> write);
  FileSink(int fd, const std::string& path, std::string temp_path)
      : fd_(fd), path_(path), temp_path_(std::move(temp_path)) {}

  const int fd_;
  const std::string& path_;  // the target, for messages
  const std::string temp_path_;
};

// Reading files a request names without blocking a thread: the file is opened with O_NONBLOCK
// (so a FIFO or a device returns at once instead of waiting for a writer) and must then be a
// regular file. FAILED_PRECONDITION "<path>: is a FIFO, not a regular file" (or a directory,
// socket, device); "<path>: cannot open (<OS reason>)" as NOT_FOUND / PERMISSION_DENIED / FAILED_PRECONDITION.
absl::Status CheckRegularFile(const std::string& path);
// CheckRegularFile, then its contents; OUT_OF_RANGE when larger than `max_bytes`.
absl::StatusOr<std::string> ReadRegularFile(const std::string& path, size_t max_bytes);

// Writes `contents` to `path` atomically (see the top of this file).
// REQUIRES: the folder of `path` exists.
absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents);

// Writes `path` atomically with what `write` appends to the sink, so a large file (tensors
// copied to the host one at a time) never has to be built in memory first. An error `write`
// returns is returned unchanged and nothing is published.
// REQUIRES: the folder of `path` exists.
absl::Status WriteFileAtomically(const std::string& path, absl::FunctionRef<absl::Status(FileSink&)> write);

// A folder published atomically: Create() makes an empty staging folder beside `target` (and
// target's missing parents); the caller fills path(); Publish() puts it in place of `target`.
// Destroying a StagedFolder that was not published (the caller gave up, or Publish() failed)
// removes the staging folder and leaves `target` as it was.
//
//   absl::StatusOr<StagedFolder> staged = StagedFolder::Create(dir);
//   if (!staged.ok()) return staged.status();
//   if (absl::Status s = Save(staged->path()); !s.ok()) return s;  // staging removed
//   return staged->Publish();
class StagedFolder {
 public:
  static absl::StatusOr<StagedFolder> Create(const std::string& target);

  StagedFolder(StagedFolder&& other) noexcept;
  StagedFolder& operator=(StagedFolder&& other) noexcept;
  StagedFolder(const StagedFolder&) = delete;
  StagedFolder& operator=(const StagedFolder&) = delete;
  ~StagedFolder();

  // The staging folder to fill: files and subfolders; symlinks are moved but not fsynced.
  const std::string& path() const { return path_; }
  // The folder Publish() writes: `target` without a trailing slash.
  const std::string& target() const { return target_; }

  // Fsyncs every file and folder under path() and path() itself, replaces `target` (whatever
  // is there, file or folder, is removed) and fsyncs target's parent.
  // REQUIRES: not published yet.
  absl::Status Publish();

 private:
  StagedFolder(std::string target, std::string path) : target_(std::move(target)), path_(std::move(path)) {}
  void RemoveStaging();

  std::string target_;
  std::string path_;  // empty once published or moved from: nothing left to clean up
};

}  // namespace odyssey
