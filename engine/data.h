// Training data: readers that turn a dataset into batches of token ids with a loss mask.
//
// Formats (DataOptions::format):
//   "kjv"   the embedded default: the King James Bible text that `bible -f gen1:1-rev22:21`
//           (Debian package bible-kjv) prints, tokenized by the byte-level tokenizer.
//   "text"  any file, byte-level tokenizer (token id = byte value, vocab 256).
//   "bin"   little-endian uint32 token ids, no header.
//   "random" uniform random token ids below vocab_size (benchmarks; no file).
//   "jsonl" one JSON object per line: {"tokens": [ids...], "loss_mask": [0/1...]}; loss_mask
//           is optional (all ones) and, when given, has one entry per token: loss_mask[i] = 1
//           makes token i a prediction target (so loss_mask[0] never counts).
// Stream formats (kjv, text, bin) yield random windows of seq_len + 1 tokens, one document per
// row. jsonl documents are packed greedily into rows of seq_len positions, in an order shuffled
// afresh each epoch (seeded with seed + epoch), cycling forever: each document keeps its own
// positions (0, 1, ...) and attends only to itself; a document longer than seq_len + 1 is cut
// into pieces of at most seq_len + 1 tokens that overlap by one token (piece k is tokens
// [k*S, k*S + S + 1)), so every label is predicted once per epoch; a piece that does not fit in
// what is left of a row starts the next row, and that tail of the row is padding (ids 0,
// loss_mask 0) with positions of its own. Documents of fewer than 2 tokens have no target and
// are skipped.
// Thread safety: a DataSource is used by one thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/types.h>

#include "absl/status/statusor.h"

namespace odyssey::engine {

// One training batch on the CPU. B rows of S positions.
struct Batch {
  torch::Tensor input_ids;     // (B, S) int64: tokens fed to the model
  torch::Tensor labels;        // (B, S) int64: the next token at each position
  torch::Tensor loss_mask;     // (B, S) float32: 1 where the label counts in the loss
  torch::Tensor position_ids;  // (B, S) int64: RoPE positions, restarting at each document
  // Per row, the lengths of the packed segments in order. Stream formats (kjv, text, bin) leave
  // it empty: each row is one document. jsonl always lists them, a trailing padding segment
  // included, so they sum to S (a row holding one document of S positions is {S}). Attention
  // never crosses a segment boundary.
  std::vector<std::vector<int64_t>> doc_lens;
  int64_t NumTargets() const;  // number of positions with loss_mask = 1
};

struct DataOptions {
  std::string format = "kjv";  // kjv | text | bin | jsonl | random
  std::string path;            // file to read; unused for kjv
  int64_t seq_len = 256;       // S: positions per row (> 0)
  int64_t batch_size = 1;      // B: rows per batch (> 0)
  int64_t vocab_size = 256;    // token ids must be < vocab_size (checked while loading)
  uint64_t seed = 0;           // window sampling and epoch shuffling
  // Cache file for the kjv text ("" = <system temp dir>/odyssey-kjv.txt).
  std::string kjv_cache;
};

class DataSource {
 public:
  virtual ~DataSource() = default;
  virtual Batch Next() = 0;
  // Tokens in the dataset (all documents).
  virtual int64_t NumTokens() const = 0;
  // A short description for logs: format, path, token count.
  virtual std::string Describe() const = 0;
};

// Validates the options and loads the dataset. Errors name the field or the file and the
// offending line/offset: unknown format, unreadable path, token id >= vocab_size, loss_mask
// length different from tokens, a dataset shorter than seq_len + 1 tokens, malformed JSON.
absl::StatusOr<std::unique_ptr<DataSource>> OpenDataSource(const DataOptions& options);

// The King James text from `bible -f gen1:1-rev22:21`, cached in `cache_path` (read when it
// exists and is non-empty; otherwise written atomically). FAILED_PRECONDITION when `bible` is
// missing or fails.
absl::StatusOr<std::string> LoadKjvText(const std::string& cache_path);

// Byte-level tokenizer: token id = byte value (vocab 256). DecodeBytes writes '?' for an id
// outside [0, 256), which a model with a larger vocabulary can sample.
std::vector<int64_t> EncodeBytes(const std::string& text);
std::string DecodeBytes(const std::vector<int64_t>& ids);

}  // namespace odyssey::engine
