#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>

#include <ATen/ATen.h>
#include <torch/utils.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/files.h"
#include "nlohmann/json.hpp"

namespace odyssey::model {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// The header length and the tensor data are little-endian on disk; we copy them as raw bytes.
static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

// A header beyond this is not a real checkpoint (Llama 405B's largest shard header is ~100 KB)
// and is more likely garbage that would make us parse gigabytes.
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;

constexpr char kSingleFile[] = "model.safetensors";
constexpr char kIndexFile[] = "model.safetensors.index.json";

#define ODYSSEY_ST_RETURN_IF_ERROR(expr) \
  do {                                   \
    absl::Status _st = (expr);           \
    if (!_st.ok()) return _st;           \
  } while (0)

struct DtypeEntry {
  const char* name;  // as spelled in safetensors headers
  torch::Dtype dtype;
  uint64_t size;  // bytes per element
};

constexpr DtypeEntry kDtypes[] = {
    {"F64", torch::kFloat64, 8}, {"F32", torch::kFloat32, 4}, {"F16", torch::kFloat16, 2},
    {"BF16", torch::kBFloat16, 2}, {"I64", torch::kInt64, 8}, {"I32", torch::kInt32, 4},
    {"I16", torch::kInt16, 2},   {"I8", torch::kInt8, 1},     {"U8", torch::kUInt8, 1},
    {"BOOL", torch::kBool, 1},
};

const DtypeEntry* FindDtype(const std::string& name) {
  for (const DtypeEntry& e : kDtypes)
    if (name == e.name) return &e;
  return nullptr;
}

const DtypeEntry* FindDtype(torch::Dtype dtype) {
  for (const DtypeEntry& e : kDtypes)
    if (dtype == e.dtype) return &e;
  return nullptr;
}

// PyTorch's spelling ("float32"), which is what a user of the model knows, rather than c10's
// enum name ("Float").
std::string TorchDtypeName(torch::Dtype dtype) {
  switch (dtype) {
    case torch::kFloat64: return "float64";
    case torch::kFloat32: return "float32";
    case torch::kFloat16: return "float16";
    case torch::kBFloat16: return "bfloat16";
    case torch::kInt64: return "int64";
    case torch::kInt32: return "int32";
    case torch::kInt16: return "int16";
    case torch::kInt8: return "int8";
    case torch::kUInt8: return "uint8";
    case torch::kBool: return "bool";
    default: return c10::toString(dtype);
  }
}

template <typename Shape>
std::string ShapeString(const Shape& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

template <typename... Args>
absl::Status FileError(const std::string& path, const Args&... args) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", args...));
}

template <typename... Args>
absl::Status TensorError(const std::string& path, const std::string& name, const Args&... args) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", name, "': ", args...));
}

// Parses one header entry into `info`; every failure names the file and the tensor.
absl::Status ParseEntry(const std::string& path, const std::string& name, const json& entry,
                        uint64_t data_size, TensorInfo* info) {
  if (!entry.is_object()) return TensorError(path, name, "header entry must be a JSON object");
  info->name = name;

  auto dtype_it = entry.find("dtype");
  if (dtype_it == entry.end()) return TensorError(path, name, "missing 'dtype'");
  if (!dtype_it->is_string()) return TensorError(path, name, "'dtype' must be a string");
  info->dtype_name = dtype_it->get<std::string>();
  const DtypeEntry* dt = FindDtype(info->dtype_name);
  if (dt == nullptr)
    return TensorError(path, name, "unknown dtype '", info->dtype_name,
                       "' (supported: F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL)");
  info->dtype = dt->dtype;

  auto shape_it = entry.find("shape");
  if (shape_it == entry.end()) return TensorError(path, name, "missing 'shape'");
  if (!shape_it->is_array()) return TensorError(path, name, "'shape' must be an array of integers");
  info->shape.clear();
  // numel * element size, checked for overflow: a crafted shape must not wrap around to match
  // a small data_offsets range.
  uint64_t nbytes = dt->size;
  for (const json& d : *shape_it) {
    if (!d.is_number_integer()) return TensorError(path, name, "'shape' must be an array of integers");
    if (d.is_number_unsigned() && d.get<uint64_t>() > uint64_t{INT64_MAX})
      return TensorError(path, name, "shape ", shape_it->dump(), " is too large");
    const int64_t dim = d.get<int64_t>();
    if (dim < 0) return TensorError(path, name, "negative dimension in shape ", shape_it->dump());
    info->shape.push_back(dim);
    if (__builtin_mul_overflow(nbytes, static_cast<uint64_t>(dim), &nbytes))
      return TensorError(path, name, "shape ", ShapeString(info->shape), " is too large");
  }

  auto off_it = entry.find("data_offsets");
  if (off_it == entry.end()) return TensorError(path, name, "missing 'data_offsets'");
  if (!off_it->is_array() || off_it->size() != 2 || !(*off_it)[0].is_number_unsigned() ||
      !(*off_it)[1].is_number_unsigned())
    return TensorError(path, name, "'data_offsets' must be [begin, end] with non-negative integers, got ",
                       off_it->dump());
  info->begin = (*off_it)[0].get<uint64_t>();
  info->end = (*off_it)[1].get<uint64_t>();
  if (info->begin > info->end)
    return TensorError(path, name, "data_offsets [", info->begin, ", ", info->end, "] have begin > end");
  if (info->end > data_size)
    return TensorError(path, name, "data_offsets [", info->begin, ", ", info->end,
                       "] reach past the end of the ", data_size,
                       "-byte data section: the file is truncated");
  const uint64_t held = info->end - info->begin;
  if (held != nbytes)
    return TensorError(path, name, "data_offsets [", info->begin, ", ", info->end, "] hold ", held,
                       " bytes, but shape ", ShapeString(info->shape), " of ", info->dtype_name,
                       " needs ", nbytes);
  return absl::OkStatus();
}

// Closes a file descriptor on scope exit unless released.
class FdCloser {
 public:
  explicit FdCloser(int fd) : fd_(fd) {}
  ~FdCloser() {
    if (fd_ >= 0) ::close(fd_);
  }
  FdCloser(const FdCloser&) = delete;
  FdCloser& operator=(const FdCloser&) = delete;
  // Closes now, reporting the error close() may carry (deferred write errors on some filesystems).
  int Close() {
    const int rc = ::close(fd_);
    fd_ = -1;
    return rc;
  }

 private:
  int fd_;
};

// "model-00002-of-00005.safetensors", as transformers' save_pretrained names shards.
std::string ShardName(size_t i, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu.safetensors", i + 1, n);
  return buf;
}

bool IsShardName(const std::string& f) {
  constexpr char kPattern[] = "model-#####-of-#####.safetensors";  // '#': a digit
  if (f.size() != sizeof(kPattern) - 1) return false;
  for (size_t i = 0; i < f.size(); ++i) {
    if (kPattern[i] == '#' ? !std::isdigit(static_cast<unsigned char>(f[i])) : f[i] != kPattern[i]) return false;
  }
  return true;
}

// Removes shard files in `dir` that a previous save left and that `keep` does not name, so a
// reader cannot mistake them for part of this checkpoint.
void RemoveStaleShards(const fs::path& dir, const std::set<std::string>& keep) {
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string f = e.path().filename().string();
    if (IsShardName(f) && keep.count(f) == 0) {
      std::error_code ignored;
      fs::remove(e.path(), ignored);
    }
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// SafetensorsFile

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(const_cast<uint8_t*>(map_), map_size_);
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
    return absl::ErrnoToStatus(errno, absl::StrCat(path, ": cannot open"));
  }
  FdCloser closer(fd);
  struct stat st;
  if (::fstat(fd, &st) != 0) return absl::ErrnoToStatus(errno, absl::StrCat(path, ": cannot stat"));
  if (!S_ISREG(st.st_mode)) return FileError(path, "not a regular file");
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8)
    return FileError(path, "file is ", size, " bytes, too short for the 8-byte header length");

  // Owned from here on, so every early return below unmaps.
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  if (map == MAP_FAILED) return absl::ErrnoToStatus(errno, absl::StrCat(path, ": mmap failed"));
  file->map_ = static_cast<const uint8_t*>(map);
  file->map_size_ = size;
  // The mapping outlives the descriptor; close it now rather than hold one per shard.
  closer.Close();

  uint64_t header_len = 0;
  std::memcpy(&header_len, file->map_, 8);
  if (header_len > kMaxHeaderBytes)
    return FileError(path, "header length ", header_len, " is larger than the ", kMaxHeaderBytes,
                     "-byte limit; this is not a safetensors file");
  if (header_len > size - 8)
    return FileError(path, "header length ", header_len, " is beyond the file's ", size - 8,
                     " bytes after the length field; the file is truncated or not safetensors");
  const char* header_begin = reinterpret_cast<const char*>(file->map_ + 8);
  const json header = json::parse(header_begin, header_begin + header_len, /*cb=*/nullptr,
                                  /*allow_exceptions=*/false);
  if (header.is_discarded()) return FileError(path, "header is not valid JSON");
  if (!header.is_object()) return FileError(path, "header must be a JSON object, got ", header.type_name());

  file->data_ = file->map_ + 8 + header_len;
  const uint64_t data_size = size - 8 - header_len;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) return FileError(path, "__metadata__ must be an object of strings");
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string())
          return FileError(path, "__metadata__ entry '", k, "' must be a string, got ", v.type_name());
        file->metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    TensorInfo info;
    ODYSSEY_ST_RETURN_IF_ERROR(ParseEntry(path, name, entry, data_size, &info));
    file->tensors_.emplace(name, std::move(info));
  }

  // Overlap check: sort the non-empty ranges by begin; each must start at or after the end of
  // the one before. Empty tensors hold no bytes and may sit anywhere.
  std::vector<const TensorInfo*> ranges;
  for (const auto& [name, info] : file->tensors_)
    if (info.end > info.begin) ranges.push_back(&info);
  std::sort(ranges.begin(), ranges.end(),
            [](const TensorInfo* a, const TensorInfo* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < ranges.size(); ++i) {
    const TensorInfo& prev = *ranges[i - 1];
    const TensorInfo& cur = *ranges[i];
    if (cur.begin < prev.end)
      return TensorError(path, cur.name, "data_offsets [", cur.begin, ", ", cur.end,
                         "] overlap tensor '", prev.name, "' at [", prev.begin, ", ", prev.end, "]");
  }
  return file;
}

absl::StatusOr<torch::Tensor> SafetensorsFile::Read(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) return absl::NotFoundError(absl::StrCat(path_, ": no tensor '", name, "'"));
  const TensorInfo& info = it->second;
  // A fresh tensor and a memcpy rather than from_blob: the data section need not be aligned
  // for the element type (the header length is only padded to 8 by convention).
  torch::Tensor t = at::empty(info.shape, at::TensorOptions().dtype(info.dtype));  // info.shape
  if (info.end > info.begin) std::memcpy(t.data_ptr(), data_ + info.begin, info.end - info.begin);
  return t;
}

absl::Status SafetensorsFile::ReadInto(const std::string& name, torch::Tensor& dst) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) return absl::NotFoundError(absl::StrCat(path_, ": no tensor '", name, "'"));
  const TensorInfo& info = it->second;
  if (!dst.defined())
    return absl::InvalidArgumentError(absl::StrCat(path_, ": tensor '", name, "': destination tensor is undefined"));
  if (dst.sizes().vec() != info.shape)
    return absl::InvalidArgumentError(absl::StrCat(path_, ": tensor '", name, "' has shape ",
                                                   ShapeString(info.shape), " but the model expects ",
                                                   ShapeString(dst.sizes())));
  const bool src_float = at::isFloatingType(info.dtype);
  const bool dst_float = at::isFloatingType(dst.scalar_type());
  if (src_float != dst_float)
    return absl::InvalidArgumentError(absl::StrCat(path_, ": tensor '", name, "' has dtype ", info.dtype_name,
                                                   " but the model expects ",
                                                   dst_float ? "a floating" : "a non-floating", " tensor (",
                                                   TorchDtypeName(dst.scalar_type()), ")"));

  torch::NoGradGuard no_grad;  // dst is usually a parameter that requires grad.
  const uint8_t* src_bytes = data_ + info.begin;
  const uint64_t esize = c10::elementSize(info.dtype);
  try {
    if (reinterpret_cast<uintptr_t>(src_bytes) % esize == 0) {
      // Aligned (the usual case): copy straight from the mapping, with no intermediate tensor,
      // so loading a large weight costs one copy. copy_ only reads src, so the const_cast
      // never lets anything write to the read-only mapping.
      const torch::Tensor src = at::from_blob(const_cast<uint8_t*>(src_bytes), info.shape,
                                              at::TensorOptions().dtype(info.dtype));  // info.shape
      dst.copy_(src);
    } else {
      absl::StatusOr<torch::Tensor> src = Read(name);  // info.shape, aligned copy
      if (!src.ok()) return src.status();
      dst.copy_(*src);
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat(path_, ": tensor '", name, "': copy into ",
                                            TorchDtypeName(dst.scalar_type()), " on ", dst.device().str(),
                                            " failed: ", e.what_without_backtrace()));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Writing

absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  // The header comes first in the file but needs only sizes and dtypes, so it is built before
  // any tensor is moved to the CPU; tensors then go to the CPU one at a time, so saving from a
  // GPU never holds a second copy of the whole model in host memory.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json& m = header["__metadata__"];
    m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
  }
  std::set<std::string> seen;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    if (name.empty() || name == "__metadata__") return FileError(path, "invalid tensor name '", name, "'");
    if (!seen.insert(name).second) return FileError(path, "duplicate tensor name '", name, "'");
    if (!t.defined()) return TensorError(path, name, "tensor is undefined");
    const DtypeEntry* dt = FindDtype(t.scalar_type());
    if (dt == nullptr)
      return TensorError(path, name, "dtype ", TorchDtypeName(t.scalar_type()), " cannot be written to safetensors");
    const uint64_t nbytes = static_cast<uint64_t>(t.numel()) * dt->size;
    header[name] = {{"dtype", dt->name}, {"shape", t.sizes().vec()}, {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string header_str;
  try {
    header_str = header.dump();
  } catch (const nlohmann::json::exception& e) {
    // dump() throws on names or metadata that are not valid UTF-8.
    return FileError(path, "cannot encode header: ", e.what());
  }
  // Pad with spaces so the data section starts 8-byte aligned, as the reference writer does;
  // readers (ours included) can then view multi-byte elements in place.
  header_str.append((8 - header_str.size() % 8) % 8, ' ');

  return WriteFileAtomically(path, [&](FileSink& out) -> absl::Status {
    const uint64_t header_len = header_str.size();
    ODYSSEY_ST_RETURN_IF_ERROR(out.Append(&header_len, 8));
    ODYSSEY_ST_RETURN_IF_ERROR(out.Append(header_str));
    for (const auto& [name, t] : tensors) {
      torch::Tensor cpu;  // t's shape, contiguous on the CPU
      try {
        cpu = t.detach().to(torch::kCPU).contiguous();
      } catch (const c10::Error& e) {
        return absl::InternalError(
            absl::StrCat(path, ": tensor '", name, "': cannot copy to the CPU: ", e.what_without_backtrace()));
      }
      if (cpu.numel() > 0) ODYSSEY_ST_RETURN_IF_ERROR(out.Append(cpu.data_ptr(), cpu.nbytes()));
    }
    return absl::OkStatus();
  });
}

absl::Status WriteSafetensorsCheckpoint(const std::string& dir,
                                        const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                                        int64_t max_shard_bytes) {
  if (max_shard_bytes <= 0)
    return absl::InvalidArgumentError(absl::StrCat(dir, ": max_shard_bytes (", max_shard_bytes, ") must be > 0"));
  // Duplicates across shards would each pass WriteSafetensors' own check; catch them before
  // anything is written.
  std::set<std::string> seen;
  for (const auto& [name, t] : tensors)
    if (!seen.insert(name).second)
      return absl::InvalidArgumentError(absl::StrCat(dir, ": duplicate tensor name '", name, "'"));

  // Greedy packing in order: a tensor opens a new shard when it would push the current one past
  // max_shard_bytes; a tensor larger than the limit gets a shard of its own.
  std::vector<std::vector<size_t>> shards;
  int64_t current = 0;
  uint64_t total_size = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const torch::Tensor& t = tensors[i].second;
    const int64_t nbytes = t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
    if (shards.empty() || (!shards.back().empty() && current + nbytes > max_shard_bytes)) {
      shards.emplace_back();
      current = 0;
    }
    shards.back().push_back(i);
    current += nbytes;
    total_size += static_cast<uint64_t>(nbytes);
  }

  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat(dir, ": cannot create directory: ", ec.message()));
  const fs::path d(dir);

  if (shards.size() <= 1) {
    ODYSSEY_ST_RETURN_IF_ERROR(WriteSafetensors((d / kSingleFile).string(), tensors));
    // A stale index would win over model.safetensors in SafetensorsCheckpoint::Open.
    fs::remove(d / kIndexFile, ec);
    RemoveStaleShards(d, {});
    return absl::OkStatus();
  }

  // Not atomic as a whole: a crash midway through rewriting a directory that already held a
  // checkpoint with the same shard count leaves a mix. Callers that need atomicity write each
  // checkpoint into a fresh directory.
  const size_t n = shards.size();
  json weight_map = json::object();
  std::set<std::string> written;
  for (size_t s = 0; s < n; ++s) {
    const std::string shard = ShardName(s, n);
    std::vector<std::pair<std::string, torch::Tensor>> part;
    part.reserve(shards[s].size());
    for (size_t i : shards[s]) {
      part.push_back(tensors[i]);
      weight_map[tensors[i].first] = shard;
    }
    ODYSSEY_ST_RETURN_IF_ERROR(WriteSafetensors((d / shard).string(), part));
    written.insert(shard);
  }
  const json index = {{"metadata", {{"total_size", total_size}}}, {"weight_map", weight_map}};
  const std::string index_str = index.dump(2) + "\n";
  const std::string index_path = (d / kIndexFile).string();
  ODYSSEY_ST_RETURN_IF_ERROR(WriteFileAtomically(index_path, index_str));
  fs::remove(d / kSingleFile, ec);
  RemoveStaleShards(d, written);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// SafetensorsCheckpoint

absl::StatusOr<SafetensorsCheckpoint> SafetensorsCheckpoint::Open(const std::string& dir) {
  SafetensorsCheckpoint ckpt;
  ckpt.dir_ = dir;
  const fs::path d(dir);
  const fs::path index_path = d / kIndexFile;
  std::error_code ec;

  if (fs::exists(index_path, ec)) {
    const std::string ip = index_path.string();
    std::ifstream in(index_path, std::ios::binary);
    if (!in) return absl::ErrnoToStatus(errno, absl::StrCat(ip, ": cannot open"));
    std::stringstream buf;
    buf << in.rdbuf();
    const json index = json::parse(buf.str(), /*cb=*/nullptr, /*allow_exceptions=*/false);
    if (index.is_discarded()) return FileError(ip, "not valid JSON");
    if (!index.is_object()) return FileError(ip, "must be a JSON object");
    auto wm = index.find("weight_map");
    if (wm == index.end() || !wm->is_object())
      return FileError(ip, "missing 'weight_map' object of tensor name -> shard file");

    std::map<std::string, size_t> shard_index;  // shard file -> index into files_
    for (const auto& [name, shard_json] : wm->items()) {
      if (!shard_json.is_string()) return FileError(ip, "tensor '", name, "': shard must be a file name string");
      const std::string shard = shard_json.get<std::string>();
      // Shards live beside the index; a path could point anywhere on the host.
      if (shard.empty() || shard.find('/') != std::string::npos || shard == "." || shard == "..")
        return FileError(ip, "tensor '", name, "': shard '", shard, "' is not a plain file name");
      auto [it, inserted] = shard_index.emplace(shard, ckpt.files_.size());
      if (inserted) {
        absl::StatusOr<std::unique_ptr<SafetensorsFile>> f = SafetensorsFile::Open((d / shard).string());
        if (!f.ok())
          return absl::Status(f.status().code(), absl::StrCat(ip, ": shard '", shard, "': ", f.status().message()));
        ckpt.files_.push_back(std::move(*f));
      }
      if (!ckpt.files_[it->second]->Has(name))
        return FileError(ip, "tensor '", name, "' is mapped to shard '", shard, "', which does not contain it");
      ckpt.where_[name] = it->second;
    }
    return ckpt;
  }

  const fs::path single = d / kSingleFile;
  if (fs::exists(single, ec)) {
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> f = SafetensorsFile::Open(single.string());
    if (!f.ok()) return f.status();
    ckpt.files_.push_back(std::move(*f));
    for (const auto& [name, info] : ckpt.files_[0]->tensors()) ckpt.where_[name] = 0;
    return ckpt;
  }
  return absl::NotFoundError(absl::StrCat(dir, ": no ", kSingleFile, " or ", kIndexFile));
}

std::vector<std::string> SafetensorsCheckpoint::Names() const {
  std::vector<std::string> names;
  names.reserve(where_.size());
  for (const auto& [name, i] : where_) names.push_back(name);  // where_ is sorted
  return names;
}

const SafetensorsFile* SafetensorsCheckpoint::FileOf(const std::string& name) const {
  auto it = where_.find(name);
  return it == where_.end() ? nullptr : files_[it->second].get();
}

absl::Status SafetensorsCheckpoint::ReadInto(const std::string& name, torch::Tensor& dst) const {
  const SafetensorsFile* f = FileOf(name);
  if (f == nullptr) return absl::NotFoundError(absl::StrCat("checkpoint ", dir_, ": no tensor '", name, "'"));
  return f->ReadInto(name, dst);
}

absl::StatusOr<torch::Tensor> SafetensorsCheckpoint::Read(const std::string& name) const {
  const SafetensorsFile* f = FileOf(name);
  if (f == nullptr) return absl::NotFoundError(absl::StrCat("checkpoint ", dir_, ": no tensor '", name, "'"));
  return f->Read(name);
}

}  // namespace odyssey::model
