// Dataset readers: option validation, the kjv/text/bin stream sources (random windows) and the
// jsonl packer. See data.h for the formats and the batch layout.
#include "engine/data.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <numeric>
#include <random>
#include <string_view>
#include <utility>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/files.h"

namespace odyssey::engine {
namespace {

constexpr int64_t kByteVocab = 256;
// Ids are stored as uint32 (4 bytes per token: the kjv text is 4.4 M tokens, a bin file may be
// billions), so a vocabulary must fit in 32 bits; bin files cannot hold larger ids anyway.
constexpr int64_t kMaxVocab = int64_t{1} << 32;

constexpr char kKjvCommand[] = "bible -f gen1:1-rev22:21";
constexpr char kKjvMissing[] =
    "dataset 'kjv' needs the `bible` program from the Debian package bible-kjv "
    "(scripts/setup.sh installs it)";

std::string ErrnoText(int err) { return std::strerror(err); }

// Reads a whole file. `what` names it in errors ("data.path", "kjv cache"). A missing file is
// NOT_FOUND; a directory or a read failure is INVALID_ARGUMENT (it is the option that is wrong).
absl::StatusOr<std::string> ReadFile(const std::string& path, const char* what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    std::string msg = absl::StrCat(what, " '", path, "': cannot open (", ErrnoText(err), ")");
    if (err == ENOENT || err == ENOTDIR) return absl::NotFoundError(msg);
    return absl::InvalidArgumentError(msg);
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat(what, " '", path, "': cannot read (not a regular file)"));
  }
  std::string data(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::read(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : EIO;
      ::close(fd);
      // n == 0: the file shrank while we read it; report it rather than train on a prefix.
      return absl::InvalidArgumentError(
          absl::StrCat(what, " '", path, "': read failed (", ErrnoText(err), ")"));
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  return data;
}

std::vector<uint32_t> BytesToIds(std::string_view bytes) {
  std::vector<uint32_t> ids(bytes.size());
  for (size_t i = 0; i < bytes.size(); ++i) ids[i] = static_cast<unsigned char>(bytes[i]);
  return ids;
}

// Copies n ids into int64 tensor storage (uint32 -> int64 widening, so no memcpy).
void FillRow(int64_t* dst, const uint32_t* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
}

// kjv, text, bin: one token stream; each row is a random window of S + 1 tokens.
class StreamSource : public DataSource {
 public:
  StreamSource(std::string description, std::vector<uint32_t> tokens, const DataOptions& options)
      : description_(std::move(description)),
        tokens_(std::move(tokens)),
        seq_len_(options.seq_len),
        batch_size_(options.batch_size),
        rng_(options.seed) {}

  Batch Next() override {
    const int64_t B = batch_size_, S = seq_len_;
    Batch batch;
    batch.input_ids = at::empty({B, S}, at::kLong);     // (B, S)
    batch.labels = at::empty({B, S}, at::kLong);        // (B, S)
    batch.loss_mask = at::ones({B, S}, at::kFloat);     // (B, S)
    batch.position_ids = at::arange(S, at::kLong).unsqueeze(0).expand({B, S}).contiguous();
    batch.doc_lens.assign(static_cast<size_t>(B), {});  // each row is one document
    int64_t* input = batch.input_ids.data_ptr<int64_t>();
    int64_t* labels = batch.labels.data_ptr<int64_t>();
    // OpenDataSource guarantees size >= S + 1, so the range is non-empty.
    std::uniform_int_distribution<int64_t> start_dist(0, NumTokens() - (S + 1));
    for (int64_t b = 0; b < B; ++b) {
      const uint32_t* window = tokens_.data() + start_dist(rng_);  // S + 1 tokens
      FillRow(input + b * S, window, S);
      FillRow(labels + b * S, window + 1, S);
    }
    return batch;
  }

  int64_t NumTokens() const override { return static_cast<int64_t>(tokens_.size()); }

  std::string Describe() const override {
    return absl::StrCat(description_, ": ", NumTokens(), " tokens");
  }

 private:
  const std::string description_;  // "<format> <path>"
  const std::vector<uint32_t> tokens_;
  const int64_t seq_len_;
  const int64_t batch_size_;
  std::mt19937_64 rng_;
};

// jsonl: documents packed into rows. Documents live back to back in one token array (with a
// parallel mask array) so that a million short documents cost no per-document allocation.
class PackedSource : public DataSource {
 public:
  struct Corpus {
    std::vector<uint32_t> tokens;
    std::vector<uint8_t> mask;       // mask[i] = 1: tokens[i] is a prediction target
    std::vector<int64_t> doc_start;  // size num_docs + 1; doc d is [doc_start[d], doc_start[d+1])
    int64_t skipped_docs = 0;        // documents of < 2 tokens (nothing to predict)
  };

  PackedSource(std::string path, Corpus corpus, const DataOptions& options)
      : path_(std::move(path)),
        corpus_(std::move(corpus)),
        seq_len_(options.seq_len),
        batch_size_(options.batch_size),
        seed_(options.seed) {
    order_.resize(NumDocs());
    StartEpoch(0);
  }

  Batch Next() override {
    const int64_t B = batch_size_, S = seq_len_;
    Batch batch;
    batch.input_ids = at::zeros({B, S}, at::kLong);     // (B, S); padding stays 0
    batch.labels = at::zeros({B, S}, at::kLong);        // (B, S)
    batch.loss_mask = at::zeros({B, S}, at::kFloat);    // (B, S)
    batch.position_ids = at::empty({B, S}, at::kLong);  // (B, S)
    batch.doc_lens.resize(static_cast<size_t>(B));
    int64_t* input = batch.input_ids.data_ptr<int64_t>();
    int64_t* labels = batch.labels.data_ptr<int64_t>();
    float* mask = batch.loss_mask.data_ptr<float>();
    int64_t* pos = batch.position_ids.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      std::vector<int64_t>& lens = batch.doc_lens[static_cast<size_t>(b)];
      int64_t fill = 0;
      while (fill < S) {
        const auto [first, last] = CurrentPiece();  // token range, >= 2 tokens
        const int64_t n = last - first - 1;           // positions it fills, <= S
        if (n > S - fill) break;  // does not fit: it opens the next row
        const int64_t row = b * S + fill;
        for (int64_t i = 0; i < n; ++i) {
          input[row + i] = corpus_.tokens[first + i];
          labels[row + i] = corpus_.tokens[first + i + 1];
          mask[row + i] = corpus_.mask[first + i + 1];
          pos[row + i] = i;
        }
        lens.push_back(n);
        fill += n;
        AdvancePiece();
      }
      if (fill < S) {
        // Padding is its own segment so that doc_lens always sums to S and attention masks
        // built from doc_lens never join padding to the last document.
        for (int64_t i = 0; i < S - fill; ++i) pos[b * S + fill + i] = i;
        lens.push_back(S - fill);
      }
    }
    return batch;
  }

  int64_t NumTokens() const override { return static_cast<int64_t>(corpus_.tokens.size()); }

  std::string Describe() const override {
    std::string s =
        absl::StrCat("jsonl ", path_, ": ", NumDocs(), " documents, ", NumTokens(), " tokens");
    if (corpus_.skipped_docs > 0) {
      absl::StrAppend(&s, " (", corpus_.skipped_docs, " documents under 2 tokens skipped)");
    }
    return s;
  }

 private:
  int64_t NumDocs() const { return static_cast<int64_t>(corpus_.doc_start.size()) - 1; }

  void StartEpoch(uint64_t epoch) {
    epoch_ = epoch;
    std::iota(order_.begin(), order_.end(), int64_t{0});
    std::mt19937_64 rng(seed_ + epoch);
    std::shuffle(order_.begin(), order_.end(), rng);
    next_doc_ = 0;
    piece_ = 0;
  }

  // Piece k of a document of n tokens is [k*S, min(k*S + S + 1, n)): consecutive pieces share
  // one token, so each label is predicted exactly once and no piece exceeds S positions.
  std::pair<int64_t, int64_t> CurrentPiece() const {
    const int64_t d = order_[next_doc_];
    const int64_t begin = corpus_.doc_start[d], end = corpus_.doc_start[d + 1];
    const int64_t first = begin + piece_ * seq_len_;
    return {first, std::min(first + seq_len_ + 1, end)};
  }

  void AdvancePiece() {
    const int64_t last = CurrentPiece().second;
    ++piece_;
    if (last < corpus_.doc_start[order_[next_doc_] + 1]) return;  // more of this document
    piece_ = 0;
    if (++next_doc_ == NumDocs()) StartEpoch(epoch_ + 1);
  }

  const std::string path_;
  const Corpus corpus_;
  const int64_t seq_len_;
  const int64_t batch_size_;
  const uint64_t seed_;
  uint64_t epoch_ = 0;
  std::vector<int64_t> order_;  // this epoch's document order
  int64_t next_doc_ = 0;        // index into order_ of the document being emitted
  int64_t piece_ = 0;           // piece of that document to emit next
};

absl::Status CheckStreamLength(const std::string& format, const std::string& path, int64_t n,
                               int64_t seq_len) {
  if (n >= seq_len + 1) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("data.", format, " '", path, "': ", n,
                                                 " tokens, but data.seq_len (", seq_len,
                                                 ") needs at least ", seq_len + 1));
}

absl::StatusOr<std::vector<uint32_t>> DecodeBin(const std::string& path, std::string_view bytes,
                                                int64_t vocab_size) {
  if (bytes.size() % 4 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("data.bin '", path, "': size ", bytes.size(),
                                                   " bytes is not a multiple of 4 (uint32 ids)"));
  }
  std::vector<uint32_t> ids(bytes.size() / 4);
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  for (size_t i = 0; i < ids.size(); ++i, p += 4) {
    // Assembled byte by byte: the file is little-endian whatever the host is.
    const uint32_t id = uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 |
                        uint32_t{p[3]} << 24;
    if (id >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("data.bin '", path, "': token ", id,
                                                     " (index ", i, ") is >= vocab_size ",
                                                     vocab_size));
    }
    ids[i] = id;
  }
  return ids;
}

bool IsBlank(std::string_view line) {
  return line.find_first_not_of(" \t\r\n") == std::string_view::npos;
}

absl::StatusOr<PackedSource::Corpus> ParseJsonl(const std::string& path, std::string_view text,
                                                int64_t vocab_size) {
  PackedSource::Corpus corpus;
  corpus.doc_start.push_back(0);
  int64_t line_no = 0;
  std::vector<uint32_t> doc;
  std::vector<uint8_t> doc_mask;
  while (!text.empty()) {
    const size_t eol = text.find('\n');
    const std::string_view line = text.substr(0, eol);
    text = eol == std::string_view::npos ? std::string_view() : text.substr(eol + 1);
    ++line_no;
    if (IsBlank(line)) continue;
    const std::string where = absl::StrCat("data.jsonl '", path, "' line ", line_no, ": ");
    auto bad = [&](auto&&... parts) {
      return absl::InvalidArgumentError(absl::StrCat(where, parts...));
    };
    nlohmann::json obj;
    try {
      obj = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error& e) {
      return bad("invalid JSON (", e.what(), ")");
    }
    if (!obj.is_object()) return bad("expected a JSON object, got ", obj.type_name());
    const auto tokens_it = obj.find("tokens");
    if (tokens_it == obj.end()) return bad("tokens is missing");
    if (!tokens_it->is_array()) return bad("tokens must be an array, got ", tokens_it->type_name());
    const nlohmann::json& tokens = *tokens_it;
    doc.clear();
    for (size_t i = 0; i < tokens.size(); ++i) {
      const nlohmann::json& t = tokens[i];
      // nlohmann parses every non-negative integer as number_unsigned.
      if (t.is_number_integer() && !t.is_number_unsigned()) {
        return bad("tokens[", i, "] (", t.get<int64_t>(), ") must be >= 0");
      }
      if (!t.is_number_unsigned()) {
        return bad("tokens[", i, "] (", t.dump(), ") must be a non-negative integer");
      }
      const uint64_t id = t.get<uint64_t>();
      if (id >= static_cast<uint64_t>(vocab_size)) {
        return bad("tokens[", i, "] (", id, ") is >= vocab_size ", vocab_size);
      }
      doc.push_back(static_cast<uint32_t>(id));
    }
    doc_mask.assign(doc.size(), 1);
    if (const auto mask_it = obj.find("loss_mask"); mask_it != obj.end()) {
      if (!mask_it->is_array()) {
        return bad("loss_mask must be an array, got ", mask_it->type_name());
      }
      if (mask_it->size() != tokens.size()) {
        return bad("loss_mask has ", mask_it->size(), " entries but tokens has ", tokens.size());
      }
      for (size_t i = 0; i < mask_it->size(); ++i) {
        const nlohmann::json& m = (*mask_it)[i];
        if (m.is_boolean()) {
          doc_mask[i] = m.get<bool>() ? 1 : 0;
        } else if (m.is_number_unsigned() && m.get<uint64_t>() <= 1) {
          doc_mask[i] = static_cast<uint8_t>(m.get<uint64_t>());
        } else {
          return bad("loss_mask[", i, "] (", m.dump(), ") must be 0, 1, true or false");
        }
      }
    }
    if (doc.size() < 2) {
      ++corpus.skipped_docs;  // no next token to predict
      continue;
    }
    corpus.tokens.insert(corpus.tokens.end(), doc.begin(), doc.end());
    corpus.mask.insert(corpus.mask.end(), doc_mask.begin(), doc_mask.end());
    corpus.doc_start.push_back(static_cast<int64_t>(corpus.tokens.size()));
  }
  if (corpus.doc_start.size() == 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data.jsonl '", path, "': no document has 2 or more tokens (nothing to predict; ",
        corpus.skipped_docs, " shorter documents skipped)"));
  }
  return corpus;
}

absl::Status ValidateOptions(const DataOptions& o) {
  static const std::vector<std::string> kFormats = {"kjv", "text", "bin", "jsonl", "random"};
  if (std::find(kFormats.begin(), kFormats.end(), o.format) == kFormats.end()) {
    return absl::InvalidArgumentError(absl::StrCat("data.format '", o.format, "' is not one of ",
                                                   absl::StrJoin(kFormats, ", ")));
  }
  if (o.seq_len <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("data.seq_len (", o.seq_len, ") must be > 0"));
  }
  if (o.batch_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("data.batch_size (", o.batch_size, ") must be > 0"));
  }
  const bool bytes = o.format == "kjv" || o.format == "text";
  if (bytes && o.vocab_size < kByteVocab) {
    return absl::InvalidArgumentError(
        absl::StrCat("data.vocab_size (", o.vocab_size, ") must be >= ", kByteVocab,
                     " for format '", o.format, "' (byte-level tokenizer)"));
  }
  if (o.vocab_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("data.vocab_size (", o.vocab_size, ") must be > 0"));
  }
  if (o.vocab_size > kMaxVocab) {
    return absl::InvalidArgumentError(absl::StrCat("data.vocab_size (", o.vocab_size,
                                                   ") must be <= ", kMaxVocab, " (uint32 ids)"));
  }
  if (o.format != "kjv" && o.format != "random" && o.path.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("data.path must be set for format '", o.format, "'"));
  }
  return absl::OkStatus();
}

// Runs `bible` and returns its stdout, or FAILED_PRECONDITION when it is missing or fails.
absl::StatusOr<std::string> RunBible() {
  // stderr goes to /dev/null: when `bible` is missing the shell's "not found" would only
  // duplicate the error we return.
  const std::string cmd = absl::StrCat(kKjvCommand, " 2>/dev/null");
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(kKjvMissing, ": popen failed (", ErrnoText(errno), ")"));
  }
  std::string text;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), pipe)) > 0) text.append(buf, n);
  const int status = ::pclose(pipe);
  if (status == -1 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    const std::string why =
        status == -1                ? absl::StrCat("pclose failed (", ErrnoText(errno), ")")
        : !WIFEXITED(status)        ? absl::StrCat("`", kKjvCommand, "` was killed")
        : WEXITSTATUS(status) == 127 ? std::string("`bible` is not on PATH")
                                     : absl::StrCat("`", kKjvCommand, "` exited with status ",
                                                    WEXITSTATUS(status));
    return absl::FailedPreconditionError(absl::StrCat(kKjvMissing, ": ", why));
  }
  if (text.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat(kKjvMissing, ": `", kKjvCommand, "` printed nothing"));
  }
  return text;
}

}  // namespace

int64_t Batch::NumTargets() const {
  if (!loss_mask.defined()) return 0;
  return loss_mask.gt(0).sum().item<int64_t>();
}

absl::StatusOr<std::string> LoadKjvText(const std::string& cache_path) {
  // An empty file (say, touched by hand or left by another tool) is regenerated, not trained on.
  std::error_code ec;
  const uintmax_t cached_size = std::filesystem::file_size(cache_path, ec);
  if (!ec && cached_size > 0) return ReadFile(cache_path, "kjv cache");
  absl::StatusOr<std::string> text = RunBible();
  if (!text.ok()) return text.status();
  // Atomic, so that a concurrent reader (another worker on the same host) sees either no cache
  // or the whole text, never a prefix.
  if (absl::Status s = WriteFileAtomically(cache_path, *text); !s.ok())
    return absl::InvalidArgumentError(absl::StrCat("kjv cache ", s.message()));
  return text;
}

absl::StatusOr<std::unique_ptr<DataSource>> OpenDataSource(const DataOptions& options) {
  if (absl::Status s = ValidateOptions(options); !s.ok()) return s;
  const int64_t S = options.seq_len;
  if (options.format == "kjv") {
    const std::string cache =
        options.kjv_cache.empty()
            ? (std::filesystem::temp_directory_path() / "odyssey-kjv.txt").string()
            : options.kjv_cache;
    absl::StatusOr<std::string> text = LoadKjvText(cache);
    if (!text.ok()) return text.status();
    if (absl::Status s = CheckStreamLength("kjv", cache, std::ssize(*text), S); !s.ok()) {
      return s;
    }
    return std::make_unique<StreamSource>(absl::StrCat("kjv ", cache), BytesToIds(*text),
                                          options);
  }

  if (options.format == "random") {
    // Uniform random ids: four windows' worth, so consecutive batches differ.
    std::vector<uint32_t> ids(static_cast<size_t>(std::max<int64_t>(4 * (S + 1), 1 << 16)));
    std::mt19937_64 rng(options.seed);
    std::uniform_int_distribution<uint32_t> id(0, static_cast<uint32_t>(options.vocab_size - 1));
    for (uint32_t& t : ids) t = id(rng);
    return std::make_unique<StreamSource>(absl::StrCat("random (vocab ", options.vocab_size, ")"), std::move(ids),
                                          options);
  }
  absl::StatusOr<std::string> data = ReadFile(options.path, "data.path");
  if (!data.ok()) return data.status();
  const std::string desc = absl::StrCat(options.format, " ", options.path);
  if (options.format == "text") {
    if (absl::Status s = CheckStreamLength("text", options.path, std::ssize(*data), S);
        !s.ok()) {
      return s;
    }
    return std::make_unique<StreamSource>(desc, BytesToIds(*data), options);
  }
  if (options.format == "bin") {
    absl::StatusOr<std::vector<uint32_t>> ids = DecodeBin(options.path, *data,
                                                          options.vocab_size);
    if (!ids.ok()) return ids.status();
    if (absl::Status s = CheckStreamLength("bin", options.path, std::ssize(*ids), S); !s.ok()) {
      return s;
    }
    return std::make_unique<StreamSource>(desc, *std::move(ids), options);
  }
  // jsonl
  absl::StatusOr<PackedSource::Corpus> corpus =
      ParseJsonl(options.path, *data, options.vocab_size);
  if (!corpus.ok()) return corpus.status();
  data->clear();
  data->shrink_to_fit();  // the file text can be larger than the parsed corpus
  return std::make_unique<PackedSource>(options.path, *std::move(corpus), options);
}

std::vector<int64_t> EncodeBytes(const std::string& text) {
  std::vector<int64_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  return ids;
}

std::string DecodeBytes(const std::vector<int64_t>& ids) {
  std::string text(ids.size(), '?');
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] >= 0 && ids[i] < kByteVocab) text[i] = static_cast<char>(ids[i]);
  }
  return text;
}

}  // namespace odyssey::engine
