#include "common/files.h"

#include <fcntl.h>
#include <stdio.h>  // renameat2
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <filesystem>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"

namespace odyssey {

namespace {

const char* FileKind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "not a regular file";
}

// An fd of the regular file `path`, opened without blocking; -1 with `error` set otherwise.
int OpenRegular(const std::string& path, absl::Status* error) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) {
    const int e = errno;
    const std::string why = std::generic_category().message(e);
    const std::string text = absl::StrCat(path, ": cannot open (", why, ")");
    *error = e == ENOENT   ? absl::NotFoundError(text)
             : e == EACCES ? absl::PermissionDeniedError(text)
                           : absl::FailedPreconditionError(text);
    return -1;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const char* kind = FileKind(st.st_mode);
    ::close(fd);
    *error = absl::FailedPreconditionError(absl::StrCat(path, ": is ", kind, ", not a regular file"));
    return -1;
  }
  // Regular files never block; clear the flag for ordinary reads.
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

}  // namespace

absl::Status CheckRegularFile(const std::string& path) {
  absl::Status error;
  const int fd = OpenRegular(path, &error);
  if (fd < 0) return error;
  ::close(fd);
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadRegularFile(const std::string& path, size_t max_bytes) {
  absl::Status error;
  const int fd = OpenRegular(path, &error);
  if (fd < 0) return error;
  std::string out;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int e = errno;
      ::close(fd);
      return absl::UnavailableError(absl::StrCat(path, ": read failed (", std::generic_category().message(e), ")"));
    }
    if (n == 0) break;
    if (out.size() + static_cast<size_t>(n) > max_bytes) {
      ::close(fd);
      return absl::OutOfRangeError(absl::StrCat(path, ": larger than ", max_bytes, " bytes"));
    }
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}
namespace {

namespace fs = std::filesystem;

// Distinguishes the temporaries of one process's concurrent writers (threads, or one thread
// writing the same target twice after a failure left a temporary behind).
std::atomic<uint64_t> temp_counter{0};

std::string UniqueSuffix() { return absl::StrCat(::getpid(), ".", temp_counter.fetch_add(1)); }

// "<target>: cannot <what>: <strerror>" with errno's code.
absl::Status ErrnoError(int err, const std::string& target, absl::string_view what) {
  return absl::ErrnoToStatus(err, absl::StrCat(target, ": cannot ", what));
}

std::string ParentOf(const std::string& path) {
  const fs::path parent = fs::path(path).parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

// fsync of a file or a folder (a folder's fsync makes the names in it durable).
absl::Status SyncPath(const std::string& path, const std::string& target, absl::string_view what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(errno, target, absl::StrCat("open ", what, " ", path, " to fsync it"));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return ErrnoError(err, target, absl::StrCat("fsync ", what, " ", path));
  return absl::OkStatus();
}

}  // namespace

absl::Status FileSink::Append(const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t w = ::write(fd_, p, size);
    if (w < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, path_, absl::StrCat("write temporary file ", temp_path_));
    }
    p += w;
    size -= static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents) {
  return WriteFileAtomically(path, [contents](FileSink& out) { return out.Append(contents); });
}

absl::Status WriteFileAtomically(const std::string& path, absl::FunctionRef<absl::Status(FileSink&)> write) {
  const std::string tmp = absl::StrCat(path, ".tmp.", UniqueSuffix());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (fd < 0) return ErrnoError(errno, path, absl::StrCat("create temporary file ", tmp));
  absl::Status s;
  {
    FileSink sink(fd, path, tmp);
    s = write(sink);
  }
  if (s.ok() && ::fsync(fd) != 0) s = ErrnoError(errno, path, absl::StrCat("fsync temporary file ", tmp));
  // close() may report a deferred write error (NFS, some FUSE file systems).
  if (::close(fd) != 0 && s.ok()) s = ErrnoError(errno, path, absl::StrCat("close temporary file ", tmp));
  if (s.ok() && ::rename(tmp.c_str(), path.c_str()) != 0)
    s = ErrnoError(errno, path, absl::StrCat("rename temporary file ", tmp, " onto it"));
  if (!s.ok()) {
    ::unlink(tmp.c_str());
    return s;
  }
  return SyncPath(ParentOf(path), path, "folder");
}

absl::StatusOr<StagedFolder> StagedFolder::Create(const std::string& target) {
  // Not lexically_normal(): "a/link/../b" is not "a/b" when link is a symlink.
  std::string t = target;
  while (t.size() > 1 && t.back() == '/') t.pop_back();
  const std::string name = fs::path(t).filename().string();
  if (name.empty() || name == "." || name == "..")
    return absl::InvalidArgumentError(absl::StrCat("\"", target, "\": not a folder name that can be published"));
  const std::string parent = ParentOf(t);
  std::error_code ec;
  fs::create_directories(parent, ec);
  if (ec) return ErrnoError(ec.value(), t, absl::StrCat("create parent folder ", parent));
  const std::string staging = (fs::path(parent) / absl::StrCat(".", name, ".tmp-", UniqueSuffix())).string();
  if (::mkdir(staging.c_str(), 0777) != 0)
    return ErrnoError(errno, t, absl::StrCat("create staging folder ", staging));
  return StagedFolder(std::move(t), staging);
}

StagedFolder::StagedFolder(StagedFolder&& other) noexcept
    : target_(std::move(other.target_)), path_(std::exchange(other.path_, std::string())) {}

StagedFolder& StagedFolder::operator=(StagedFolder&& other) noexcept {
  if (this != &other) {
    RemoveStaging();
    target_ = std::move(other.target_);
    path_ = std::exchange(other.path_, std::string());
  }
  return *this;
}

StagedFolder::~StagedFolder() { RemoveStaging(); }

void StagedFolder::RemoveStaging() {
  if (path_.empty()) return;
  std::error_code ignored;  // best effort: a leftover is a hidden folder nobody reads
  fs::remove_all(path_, ignored);
  path_.clear();
}

absl::Status StagedFolder::Publish() {
  if (path_.empty()) return absl::FailedPreconditionError(absl::StrCat(target_, ": already published"));
  // The files reach the disk before the rename publishes them, and the rename before the
  // caller tells anyone: a machine crash leaves the old folder or the new one, never a torn one.
  std::error_code ec;
  for (fs::recursive_directory_iterator it(path_, ec), end; !ec && it != end; it.increment(ec)) {
    const fs::file_status st = it->symlink_status(ec);
    if (ec) break;
    if (!fs::is_regular_file(st) && !fs::is_directory(st)) continue;
    if (absl::Status s = SyncPath(it->path().string(), target_, "staged file"); !s.ok()) return s;
  }
  if (ec) return ErrnoError(ec.value(), target_, absl::StrCat("list staging folder ", path_));
  if (absl::Status s = SyncPath(path_, target_, "staging folder"); !s.ok()) return s;

  const std::string staging = path_;
  bool exchanged = false;
  if (fs::exists(fs::symlink_status(target_, ec))) {
    // Swapping the two names replaces the old folder in one step; the old one then sits at the
    // staging name and is removed. File systems that cannot (EINVAL) get remove + rename, with
    // a moment in which no folder is at the target.
    if (::renameat2(AT_FDCWD, staging.c_str(), AT_FDCWD, target_.c_str(), RENAME_EXCHANGE) == 0) {
      exchanged = true;
    } else if (errno != EINVAL && errno != ENOSYS) {
      return ErrnoError(errno, target_, absl::StrCat("exchange staging folder ", staging, " with it"));
    } else {
      fs::remove_all(target_, ec);
      if (ec) return ErrnoError(ec.value(), target_, "remove the folder being replaced");
    }
  }
  if (!exchanged && ::rename(staging.c_str(), target_.c_str()) != 0)
    return ErrnoError(errno, target_, absl::StrCat("rename staging folder ", staging, " onto it"));
  // Published: from here the staging name holds the old folder (after an exchange) or nothing.
  RemoveStaging();
  return SyncPath(ParentOf(target_), target_, "parent folder");
}

}  // namespace odyssey
