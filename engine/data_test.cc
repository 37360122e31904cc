// Tests for the dataset readers: what a training run would notice (wrong next-token labels, a
// label trained twice or never, padding that counts in the loss, an unhelpful error message).
#include "engine/data.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace odyssey::engine {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// Test files live in one folder per process (so parallel ctest runs do not clash), removed
// when the tests end.
std::string TempDirForTest() {
  static const std::string dir = [] {
    std::string d = absl::StrCat(::testing::TempDir(), "/odyssey_data_test_", ::getpid());
    std::filesystem::create_directories(d);
    return d;
  }();
  return dir;
}

class RemoveTempDir : public ::testing::Environment {
 public:
  void TearDown() override { std::filesystem::remove_all(TempDirForTest()); }
};
[[maybe_unused]] ::testing::Environment* const kRemoveTempDir =
    ::testing::AddGlobalTestEnvironment(new RemoveTempDir);

std::string TempPath(const std::string& name) { return TempDirForTest() + "/" + name; }

std::string WriteFile(const std::string& name, const std::string& content) {
  const std::string path = TempPath(name);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << content;
  out.close();
  EXPECT_TRUE(out.good()) << path;
  return path;
}

std::string LittleEndianIds(const std::vector<uint32_t>& ids) {
  std::string bytes;
  for (uint32_t id : ids) {
    for (int k = 0; k < 4; ++k) bytes.push_back(static_cast<char>((id >> (8 * k)) & 0xff));
  }
  return bytes;
}

std::vector<int64_t> Row(const torch::Tensor& t, int64_t b) {
  torch::Tensor row = t[b].to(torch::kLong).contiguous();  // (S,)
  return std::vector<int64_t>(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + row.numel());
}

std::vector<float> MaskRow(const torch::Tensor& t, int64_t b) {
  torch::Tensor row = t[b].contiguous();  // (S,)
  return std::vector<float>(row.data_ptr<float>(), row.data_ptr<float>() + row.numel());
}

void ExpectBatchShapes(const Batch& batch, int64_t B, int64_t S) {
  for (const torch::Tensor* t : {&batch.input_ids, &batch.labels, &batch.position_ids}) {
    EXPECT_EQ(t->sizes(), (std::vector<int64_t>{B, S}));
    EXPECT_EQ(t->scalar_type(), torch::kLong);
    EXPECT_TRUE(t->device().is_cpu());
  }
  EXPECT_EQ(batch.loss_mask.sizes(), (std::vector<int64_t>{B, S}));
  EXPECT_EQ(batch.loss_mask.scalar_type(), torch::kFloat);
  EXPECT_EQ(batch.doc_lens.size(), static_cast<size_t>(B));
}

std::unique_ptr<DataSource> MustOpen(const DataOptions& options) {
  absl::StatusOr<std::unique_ptr<DataSource>> source = OpenDataSource(options);
  EXPECT_TRUE(source.ok()) << source.status();
  return source.ok() ? *std::move(source) : nullptr;
}

TEST(ByteTokenizerTest, RoundTripsEveryByteValue) {
  std::string text;
  for (int c = 0; c < 256; ++c) text.push_back(static_cast<char>(c));
  text += "In the beginning";
  const std::vector<int64_t> ids = EncodeBytes(text);
  ASSERT_EQ(ids.size(), text.size());
  for (int c = 0; c < 256; ++c) EXPECT_EQ(ids[c], c);  // bytes >= 0x80 are not negative
  EXPECT_EQ(DecodeBytes(ids), text);
  EXPECT_EQ(DecodeBytes({72, 300, -1, 105}), "H??i");
}

TEST(TextSourceTest, WindowsAreConsecutiveBytesOfTheFile) {
  // Random bytes (all 256 values): a 33-byte window occurs once, so its offset is unambiguous.
  std::mt19937 gen(7);
  std::string content(4000, '\0');
  for (char& c : content) c = static_cast<char>(gen() & 0xff);
  const std::string path = WriteFile("windows.txt", content);
  DataOptions options;
  options.format = "text";
  options.path = path;
  options.seq_len = 32;
  options.batch_size = 4;
  options.seed = 3;
  std::unique_ptr<DataSource> source = MustOpen(options);
  ASSERT_NE(source, nullptr);
  EXPECT_EQ(source->NumTokens(), 4000);
  EXPECT_EQ(source->Describe(), absl::StrCat("text ", path, ": 4000 tokens"));

  std::set<size_t> offsets;
  for (int step = 0; step < 3; ++step) {
    const Batch batch = source->Next();
    ExpectBatchShapes(batch, 4, 32);
    EXPECT_EQ(batch.NumTargets(), 4 * 32);
    for (int64_t b = 0; b < 4; ++b) {
      EXPECT_TRUE(batch.doc_lens[b].empty());
      const std::vector<int64_t> input = Row(batch.input_ids, b);
      const std::vector<int64_t> labels = Row(batch.labels, b);
      const size_t offset = content.find(DecodeBytes(input));
      ASSERT_NE(offset, std::string::npos) << "row " << b << " is not a window of the file";
      offsets.insert(offset);
      for (int64_t s = 0; s < 32; ++s) {
        EXPECT_EQ(labels[s], static_cast<unsigned char>(content[offset + s + 1])) << s;
      }
      std::vector<int64_t> expected_positions(32);
      for (int64_t s = 0; s < 32; ++s) expected_positions[s] = s;
      EXPECT_EQ(Row(batch.position_ids, b), expected_positions);
    }
  }
  EXPECT_GT(offsets.size(), 6u) << "windows should start at random offsets";
}

TEST(TextSourceTest, SeedFixesTheWindows) {
  std::string content;
  for (int i = 0; i < 3000; ++i) content.push_back(static_cast<char>('a' + (i * 7919) % 26));
  DataOptions options;
  options.format = "text";
  options.path = WriteFile("seed.txt", content);
  options.seq_len = 16;
  options.batch_size = 8;
  options.seed = 11;
  std::unique_ptr<DataSource> a = MustOpen(options), b = MustOpen(options);
  options.seed = 12;
  std::unique_ptr<DataSource> c = MustOpen(options);
  ASSERT_TRUE(a && b && c);
  const Batch ba = a->Next(), bb = b->Next(), bc = c->Next();
  EXPECT_TRUE(torch::equal(ba.input_ids, bb.input_ids));
  EXPECT_FALSE(torch::equal(ba.input_ids, bc.input_ids));
}

TEST(BinSourceTest, ReadsLittleEndianUint32Ids) {
  // Distinct ids above 65535, so a wrong byte order or width gives wrong (or rejected) ids.
  std::vector<uint32_t> ids(500);
  for (uint32_t i = 0; i < ids.size(); ++i) ids[i] = (i * 7919u + 70000u) % 100000u;
  DataOptions options;
  options.format = "bin";
  options.path = WriteFile("ids.bin", LittleEndianIds(ids));
  options.seq_len = 8;
  options.batch_size = 5;
  options.vocab_size = 100000;
  std::unique_ptr<DataSource> source = MustOpen(options);
  ASSERT_NE(source, nullptr);
  EXPECT_EQ(source->NumTokens(), 500);
  const Batch batch = source->Next();
  ExpectBatchShapes(batch, 5, 8);
  for (int64_t b = 0; b < 5; ++b) {
    const std::vector<int64_t> input = Row(batch.input_ids, b);
    const std::vector<int64_t> labels = Row(batch.labels, b);
    const auto it = std::find(ids.begin(), ids.end(), static_cast<uint32_t>(input[0]));
    ASSERT_NE(it, ids.end()) << input[0] << " is not an id of the file";
    const size_t offset = it - ids.begin();
    ASSERT_LE(offset + 9, ids.size());
    for (int64_t s = 0; s < 8; ++s) {
      EXPECT_EQ(input[s], ids[offset + s]);
      EXPECT_EQ(labels[s], ids[offset + s + 1]);
    }
  }
}

TEST(BinSourceTest, RejectsIdAtOrAboveVocabNamingIndexAndValue) {
  std::vector<uint32_t> ids(100, 5);
  ids[57] = 1234;
  DataOptions options;
  options.format = "bin";
  options.path = WriteFile("big_id.bin", LittleEndianIds(ids));
  options.seq_len = 8;
  const absl::Status status = OpenDataSource(options).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr(options.path));
  EXPECT_THAT(status.message(), HasSubstr("token 1234 (index 57) is >= vocab_size 256"));
}

TEST(BinSourceTest, RejectsSizeNotAMultipleOf4) {
  DataOptions options;
  options.format = "bin";
  options.path = WriteFile("ragged.bin", std::string(10, '\1'));
  options.seq_len = 1;
  const absl::Status status = OpenDataSource(options).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr(options.path));
  EXPECT_THAT(status.message(), HasSubstr("size 10 bytes is not a multiple of 4"));
}

// jsonl packing. Document d of n tokens holds ids 20*d + 1 ... 20*d + n: an id names its
// document and index, the next token is always id + 1, and 0 can only be padding.
constexpr int64_t kS = 4;
const std::vector<int64_t> kDocLen = {3, 5, 2, 9};
// loss_mask of document 1 (entry 0 never counts: token 0 is no one's label).
const std::vector<int> kDoc1Mask = {1, 0, 1, 1, 0};

std::string PackingJsonl() {
  std::string text;
  for (size_t d = 0; d < kDocLen.size(); ++d) {
    std::string tokens;
    for (int64_t i = 0; i < kDocLen[d]; ++i) {
      absl::StrAppend(&tokens, i ? "," : "", 20 * d + i + 1);
    }
    absl::StrAppend(&text, "{\"tokens\": [", tokens, "]");
    if (d == 1) absl::StrAppend(&text, ", \"loss_mask\": [1, 0, true, 1, false]");
    absl::StrAppend(&text, "}\n");
    if (d == 1) text += "\n   \n{\"tokens\": [99]}\n{\"tokens\": []}\n";  // skipped
  }
  return text;
}

struct Segment {
  int64_t doc = -1;         // -1: padding
  int64_t first_label = 0;  // index in the document of the segment's first label
  int64_t len = 0;          // positions
};

// Checks one packed row against the documents and returns its segments in order.
std::vector<Segment> CheckRow(const Batch& batch, int64_t b) {
  const std::vector<int64_t> input = Row(batch.input_ids, b);
  const std::vector<int64_t> labels = Row(batch.labels, b);
  const std::vector<int64_t> pos = Row(batch.position_ids, b);
  const std::vector<float> mask = MaskRow(batch.loss_mask, b);
  const std::vector<int64_t>& lens = batch.doc_lens[b];
  int64_t sum = 0;
  for (int64_t len : lens) sum += len;
  EXPECT_EQ(sum, kS) << "doc_lens must cover the row";
  std::vector<Segment> segments;
  int64_t at = 0;
  for (size_t k = 0; k < lens.size() && at + lens[k] <= kS; at += lens[k], ++k) {
    Segment seg;
    seg.len = lens[k];
    EXPECT_GT(seg.len, 0);
    if (input[at] == 0) {
      EXPECT_EQ(k + 1, lens.size()) << "padding is the last segment";
      for (int64_t i = at; i < at + seg.len; ++i) {
        EXPECT_EQ(input[i], 0);
        EXPECT_EQ(labels[i], 0);
        EXPECT_EQ(mask[i], 0.0f) << "padding must not count in the loss";
        EXPECT_EQ(pos[i], i - at);
      }
      segments.push_back(seg);
      continue;
    }
    seg.doc = (input[at] - 1) / 20;
    seg.first_label = labels[at] - 1 - 20 * seg.doc;
    EXPECT_EQ((seg.first_label - 1) % kS, 0) << "a piece starts at a multiple of S";
    for (int64_t i = at; i < at + seg.len; ++i) {
      EXPECT_EQ(pos[i], i - at) << "positions restart at each document";
      EXPECT_EQ((input[i] - 1) / 20, seg.doc) << "a segment holds one document";
      EXPECT_EQ(labels[i], input[i] + 1) << "the label is the next token";
      const int64_t label_index = labels[i] - 1 - 20 * seg.doc;
      EXPECT_GE(label_index, 1);
      EXPECT_LT(label_index, kDocLen[seg.doc]);
      const float expected = seg.doc == 1 ? kDoc1Mask[label_index] : 1.0f;
      EXPECT_EQ(mask[i], expected) << "doc " << seg.doc << " label " << label_index;
    }
    segments.push_back(seg);
  }
  return segments;
}

TEST(JsonlSourceTest, PacksDocumentsAndPredictsEveryLabelOncePerEpoch) {
  DataOptions options;
  options.format = "jsonl";
  options.path = WriteFile("pack.jsonl", PackingJsonl());
  options.seq_len = kS;
  options.batch_size = 1;
  options.seed = 5;
  std::unique_ptr<DataSource> source = MustOpen(options);
  ASSERT_NE(source, nullptr);
  EXPECT_EQ(source->NumTokens(), 3 + 5 + 2 + 9);
  EXPECT_EQ(source->Describe(),
            absl::StrCat("jsonl ", options.path,
                         ": 4 documents, 19 tokens (2 documents under 2 tokens skipped)"));

  constexpr int kRows = 120;
  std::vector<Segment> stream;  // documents in emission order, padding dropped
  int64_t pad_before = 0;       // padding that ended the previous row
  for (int r = 0; r < kRows; ++r) {
    const Batch batch = source->Next();
    ExpectBatchShapes(batch, 1, kS);
    const std::vector<Segment> row = CheckRow(batch, 0);
    ASSERT_FALSE(row.empty());
    ASSERT_NE(row.front().doc, -1) << "a row starts with a document";
    if (pad_before > 0) {
      EXPECT_GT(row.front().len, pad_before) << "greedy: it would have fit in the padding";
    }
    pad_before = row.back().doc == -1 ? row.back().len : 0;
    int64_t targets = 0;
    for (const Segment& s : row) {
      if (s.doc == -1) continue;
      stream.push_back(s);
      for (int64_t i = 0; i < s.len; ++i) {
        targets += s.doc == 1 ? kDoc1Mask[s.first_label + i] : 1;
      }
    }
    EXPECT_EQ(batch.NumTargets(), targets);
  }

  // Pieces per epoch: docs 0, 1, 2 one each; doc 3 (9 tokens, 8 labels) two of 4 labels each.
  constexpr size_t kPiecesPerEpoch = 5;
  const size_t epochs = stream.size() / kPiecesPerEpoch;
  ASSERT_GE(epochs, 20u);
  std::set<std::vector<int64_t>> orders;
  for (size_t e = 0; e < epochs; ++e) {
    std::map<std::pair<int64_t, int64_t>, int> predicted;  // (doc, label index) -> times
    std::vector<int64_t> order;
    for (size_t k = e * kPiecesPerEpoch; k < (e + 1) * kPiecesPerEpoch; ++k) {
      const Segment& s = stream[k];
      for (int64_t i = 0; i < s.len; ++i) ++predicted[{s.doc, s.first_label + i}];
      if (s.doc == 3 && s.first_label == 5) {
        EXPECT_EQ(order.back(), 3) << "the pieces of a document are consecutive";
        EXPECT_EQ(s.len, 4);
      } else {
        order.push_back(s.doc);
      }
    }
    for (int64_t d = 0; d < 4; ++d) {
      for (int64_t i = 1; i < kDocLen[d]; ++i) {
        EXPECT_EQ((predicted[{d, i}]), 1) << "epoch " << e << " doc " << d << " label " << i;
      }
    }
    EXPECT_EQ(predicted.size(), 2u + 4u + 1u + 8u) << "epoch " << e;
    orders.insert(order);
  }
  EXPECT_GT(orders.size(), 1u) << "the document order is reshuffled each epoch";
}

TEST(JsonlSourceTest, PackingIsIndependentOfBatchSize) {
  DataOptions options;
  options.format = "jsonl";
  options.path = WriteFile("pack_b.jsonl", PackingJsonl());
  options.seq_len = kS;
  options.seed = 9;
  options.batch_size = 1;
  std::unique_ptr<DataSource> one = MustOpen(options);
  options.batch_size = 3;
  std::unique_ptr<DataSource> three = MustOpen(options);
  ASSERT_TRUE(one && three);
  for (int step = 0; step < 10; ++step) {
    const Batch big = three->Next();
    ExpectBatchShapes(big, 3, kS);
    for (int64_t b = 0; b < 3; ++b) {
      const Batch small = one->Next();
      EXPECT_TRUE(torch::equal(big.input_ids[b], small.input_ids[0]));
      EXPECT_TRUE(torch::equal(big.labels[b], small.labels[0]));
      EXPECT_TRUE(torch::equal(big.loss_mask[b], small.loss_mask[0]));
      EXPECT_TRUE(torch::equal(big.position_ids[b], small.position_ids[0]));
      EXPECT_EQ(big.doc_lens[b], small.doc_lens[0]);
      CheckRow(big, b);
    }
  }
}

TEST(JsonlSourceTest, RowHoldingOneDocumentListsItsLength) {
  DataOptions options;
  options.format = "jsonl";
  options.path = WriteFile("exact.jsonl", "{\"tokens\": [1, 2, 3, 4, 5]}\n");
  options.seq_len = kS;
  options.batch_size = 2;
  std::unique_ptr<DataSource> source = MustOpen(options);
  ASSERT_NE(source, nullptr);
  const Batch batch = source->Next();
  EXPECT_THAT(batch.doc_lens, ElementsAre(ElementsAre(kS), ElementsAre(kS)));
  EXPECT_EQ(Row(batch.input_ids, 1), (std::vector<int64_t>{1, 2, 3, 4}));
  EXPECT_EQ(Row(batch.labels, 1), (std::vector<int64_t>{2, 3, 4, 5}));
  EXPECT_EQ(batch.NumTargets(), 2 * kS);
}

// Bad options and bad content: the error names the field or file, and the rule.
absl::Status OpenStatus(const DataOptions& options) { return OpenDataSource(options).status(); }

void ExpectError(const absl::Status& status, absl::StatusCode code,
                 const std::vector<std::string>& parts) {
  EXPECT_EQ(status.code(), code) << status;
  for (const std::string& part : parts) EXPECT_THAT(status.message(), HasSubstr(part));
}

TEST(DataOptionsTest, RejectsUnknownFormat) {
  DataOptions options;
  options.format = "xml";
  ExpectError(OpenStatus(options), absl::StatusCode::kInvalidArgument,
              {"data.format 'xml' is not one of kjv, text, bin, jsonl"});
}

TEST(DataOptionsTest, RejectsNonPositiveSeqLenAndBatchSize) {
  DataOptions options;
  options.seq_len = 0;
  ExpectError(OpenStatus(options), absl::StatusCode::kInvalidArgument,
              {"data.seq_len (0) must be > 0"});
  options.seq_len = 8;
  options.batch_size = -1;
  ExpectError(OpenStatus(options), absl::StatusCode::kInvalidArgument,
              {"data.batch_size (-1) must be > 0"});
}

TEST(DataOptionsTest, RejectsVocabTooSmallForBytes) {
  DataOptions options;
  options.format = "text";
  options.path = WriteFile("vocab.txt", "hello world, hello world");
  options.vocab_size = 100;
  ExpectError(OpenStatus(options), absl::StatusCode::kInvalidArgument,
              {"data.vocab_size (100) must be >= 256"});
}

TEST(DataOptionsTest, RejectsMissingPath) {
  DataOptions options;
  options.format = "text";
  ExpectError(OpenStatus(options), absl::StatusCode::kInvalidArgument,
              {"data.path must be set for format 'text'"});
}

TEST(DataOptionsTest, RejectsUnreadablePath) {
  DataOptions options;
  options.format = "text";
  options.path = "/nonexistent/odyssey/data.txt";
  ExpectError(OpenStatus(options), absl::StatusCode::kNotFound,
              {"data.path '/nonexistent/odyssey/data.txt': cannot open (No such file or "
               "directory)"});
  options.path = ::testing::TempDir();  // a directory
  ExpectError(OpenStatus(options), absl::StatusCode::kInvalidArgument,
              {"data.path '", "not a regular file"});
}

TEST(DataOptionsTest, RejectsDatasetShorterThanOneWindow) {
  DataOptions options;
  options.format = "text";
  options.path = WriteFile("short.txt", "0123456789");
  options.seq_len = 16;
  ExpectError(OpenStatus(options), absl::StatusCode::kInvalidArgument,
              {options.path, "10 tokens", "data.seq_len (16) needs at least 17"});
  options.seq_len = 9;  // exactly seq_len + 1 tokens is enough
  EXPECT_TRUE(OpenDataSource(options).ok());
}

TEST(JsonlErrorsTest, BadJsonNamesTheLine) {
  DataOptions options;
  options.format = "jsonl";
  options.path = WriteFile("bad.jsonl", "{\"tokens\": [1, 2]}\n\n{\"tokens\": [1, 2\n");
  ExpectError(OpenStatus(options), absl::StatusCode::kInvalidArgument,
              {"data.jsonl '" + options.path + "' line 3: invalid JSON"});
  options.path = WriteFile("not_object.jsonl", "[1, 2, 3]\n");
  ExpectError(OpenStatus(options), absl::StatusCode::kInvalidArgument,
              {"line 1: expected a JSON object"});
  options.path = WriteFile("no_tokens.jsonl", "{\"text\": \"hi\"}\n");
  ExpectError(OpenStatus(options), absl::StatusCode::kInvalidArgument,
              {"line 1: tokens is missing"});
}

TEST(JsonlErrorsTest, LossMaskLengthMismatch) {
  DataOptions options;
  options.format = "jsonl";
  options.path = WriteFile("mask_len.jsonl",
                           "{\"tokens\": [1, 2]}\n"
                           "{\"tokens\": [1, 2, 3, 4, 5, 6], \"loss_mask\": [1, 1, 1, 1, 1]}\n");
  ExpectError(OpenStatus(options), absl::StatusCode::kInvalidArgument,
              {"data.jsonl '" + options.path +
               "' line 2: loss_mask has 5 entries but tokens has 6"});
  options.path = WriteFile("mask_value.jsonl", "{\"tokens\": [1, 2], \"loss_mask\": [1, 2]}\n");
  ExpectError(OpenStatus(options), absl::StatusCode::kInvalidArgument,
              {"line 1: loss_mask[1] (2) must be 0, 1, true or false"});
}

TEST(JsonlErrorsTest, TokenOutOfRange) {
  DataOptions options;
  options.format = "jsonl";
  options.path = WriteFile("big.jsonl", "{\"tokens\": [1, 300, 2]}\n");
  ExpectError(OpenStatus(options), absl::StatusCode::kInvalidArgument,
              {"'" + options.path + "' line 1: tokens[1] (300) is >= vocab_size 256"});
  options.path = WriteFile("negative.jsonl", "{\"tokens\": [1, 2]}\n{\"tokens\": [-1, 2]}\n");
  ExpectError(OpenStatus(options), absl::StatusCode::kInvalidArgument,
              {"line 2: tokens[0] (-1) must be >= 0"});
  options.path = WriteFile("float.jsonl", "{\"tokens\": [1.5, 2]}\n");
  ExpectError(OpenStatus(options), absl::StatusCode::kInvalidArgument,
              {"line 1: tokens[0] (1.5) must be a non-negative integer"});
}

TEST(JsonlErrorsTest, NoDocumentToPredict) {
  DataOptions options;
  options.format = "jsonl";
  options.path = WriteFile("empty.jsonl", "{\"tokens\": [7]}\n\n");
  ExpectError(OpenStatus(options), absl::StatusCode::kInvalidArgument,
              {options.path, "no document has 2 or more tokens"});
}

// setup.sh installs bible-kjv, so its absence is a broken environment, not a reason to skip.
TEST(KjvTest, LoadsTheBibleAndCachesIt) {
  ASSERT_EQ(std::system("command -v bible >/dev/null 2>&1"), 0)
      << "`bible` (Debian package bible-kjv) is not on PATH: run scripts/setup.sh";
  const std::string cache = TempPath("kjv.txt");
  std::filesystem::remove(cache);
  absl::StatusOr<std::string> text = LoadKjvText(cache);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_GT(text->size(), 4'000'000u);
  EXPECT_THAT(*text, StartsWith("Ge1:1 In the beginning"));
  ASSERT_EQ(std::filesystem::file_size(cache), text->size());

  // The second load reads the cache: prove it by making the cache differ from `bible`.
  {
    std::ofstream out(cache, std::ios::app);
    out << "cached";
  }
  absl::StatusOr<std::string> again = LoadKjvText(cache);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, *text + "cached");

  DataOptions options;
  options.format = "kjv";
  options.kjv_cache = cache;
  options.seq_len = 64;
  options.batch_size = 2;
  std::unique_ptr<DataSource> source = MustOpen(options);
  ASSERT_NE(source, nullptr);
  EXPECT_EQ(source->NumTokens(), static_cast<int64_t>(again->size()));
  const Batch batch = source->Next();
  ExpectBatchShapes(batch, 2, 64);
  EXPECT_NE(again->find(DecodeBytes(Row(batch.input_ids, 0))), std::string::npos);
  std::filesystem::remove(cache);
}

TEST(KjvTest, MissingBibleIsAFailedPrecondition) {
  const char* old_path = std::getenv("PATH");
  const std::string saved = old_path ? old_path : "";
  ::setenv("PATH", "/nonexistent", 1);
  const absl::StatusOr<std::string> text = LoadKjvText(TempPath("kjv_missing.txt"));
  ::setenv("PATH", saved.c_str(), 1);
  ExpectError(text.status(), absl::StatusCode::kFailedPrecondition,
              {"dataset 'kjv' needs the `bible` program from the Debian package bible-kjv "
               "(scripts/setup.sh installs it)"});
  EXPECT_FALSE(std::filesystem::exists(TempPath("kjv_missing.txt")));
}

}  // namespace
}  // namespace odyssey::engine
