// Reading and writing Hugging Face safetensors files and sharded checkpoint directories.
//
// Format: 8-byte little-endian header length N, N bytes of JSON
//   {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"format": "pt"}}
// then the raw little-endian data; offsets are relative to the end of the header.
// A checkpoint directory holds either model.safetensors, or shards plus
// model.safetensors.index.json ({"metadata": {"total_size": n}, "weight_map": {name: file}}).
//
// Every malformed input (bad header, truncated data, overlapping or out-of-range offsets,
// unknown dtype, shape/offset mismatch, missing tensor) is an error Status whose message names
// the file and, where there is one, the tensor. Nothing here aborts on bad input.
// Thread safety: SafetensorsFile is immutable after Open and may be read from many threads.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/types.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace odyssey::model {

struct TensorInfo {
  std::string name;
  torch::Dtype dtype;
  std::string dtype_name;  // as written in the file: "F32", "BF16", ...
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets into the data section
  uint64_t end = 0;
};

// One .safetensors file, memory-mapped read-only.
class SafetensorsFile {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool Has(const std::string& name) const { return tensors_.count(name) > 0; }

  // A CPU tensor that owns a copy of the data, in the file's dtype.
  absl::StatusOr<torch::Tensor> Read(const std::string& name) const;
  // Copies tensor `name` into `dst` (any device, any floating dtype), converting the dtype.
  // Errors if the shape differs from dst's, or if a floating tensor is asked from an integer
  // one (or the reverse).
  absl::Status ReadInto(const std::string& name, torch::Tensor& dst) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
  const uint8_t* map_ = nullptr;  // whole file
  size_t map_size_ = 0;
  const uint8_t* data_ = nullptr;  // start of data section
};

// Writes `tensors` (any device/dtype among F32/F16/BF16/I64/I32/U8/...; written as they are)
// to `path` atomically (common/files.h: a temporary beside it, fsynced, renamed over it).
absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                              const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

// A checkpoint directory: model.safetensors, or the shards named by the index json.
class SafetensorsCheckpoint {
 public:
  static absl::StatusOr<SafetensorsCheckpoint> Open(const std::string& dir);
  // Tensor names across all shards, sorted.
  std::vector<std::string> Names() const;
  bool Has(const std::string& name) const { return where_.count(name) > 0; }
  // The file holding `name`, or nullptr.
  const SafetensorsFile* FileOf(const std::string& name) const;
  absl::Status ReadInto(const std::string& name, torch::Tensor& dst) const;
  absl::StatusOr<torch::Tensor> Read(const std::string& name) const;
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t> where_;  // tensor name -> index into files_
};

// Writes tensors into `dir` as model.safetensors, or, when their total size exceeds
// max_shard_bytes, as model-0000i-of-0000n.safetensors shards plus the index json, the way
// transformers' save_pretrained names them. Tensors are kept in the given order.
absl::Status WriteSafetensorsCheckpoint(const std::string& dir,
                                        const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                                        int64_t max_shard_bytes = int64_t{5} << 30);

}  // namespace odyssey::model
