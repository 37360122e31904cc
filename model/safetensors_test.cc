// Tests for model/safetensors: bit-exact round trips, dtype conversion on load, sharded
// checkpoints, and one test per malformed input, each checking the status code and that the
// message names the file, the tensor and what is wrong.
#include "model/safetensors.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <string>

#include <ATen/ATen.h>
#include <torch/types.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace odyssey::model {
namespace {

namespace fs = std::filesystem;
using Tensors = std::vector<std::pair<std::string, torch::Tensor>>;

// Each test gets its own directory, unique across concurrent runs of this binary.
class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / absl::StrCat("odyssey_safetensors_test_", ::getpid(), "_", info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    torch::manual_seed(0);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string Path(const std::string& file) const { return (dir_ / file).string(); }

  fs::path dir_;
};

// The raw bytes of a tensor, for crafting files and for bit-exact comparison.
std::string Bytes(const torch::Tensor& t) {
  const torch::Tensor c = t.contiguous();  // t's shape
  return std::string(static_cast<const char*>(c.data_ptr()), c.nbytes());
}

// Writes a file by hand: 8-byte little-endian header length (`header.size()` unless
// `header_len` overrides it), the header, then `data`.
void WriteRaw(const std::string& path, const std::string& header, const std::string& data,
              std::optional<uint64_t> header_len = std::nullopt) {
  const uint64_t n = header_len.value_or(header.size());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << header << data;
  ASSERT_TRUE(out.good()) << path;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buf;
  buf << in.rdbuf();
  return buf.str();
}

// Checks the code, that the message starts with `prefix` (the file at fault) and contains
// every one of `parts`.
void ExpectError(const absl::Status& s, absl::StatusCode code, const std::string& prefix,
                 std::initializer_list<std::string> parts) {
  EXPECT_EQ(s.code(), code) << s;
  const std::string msg(s.message());
  EXPECT_TRUE(absl::StartsWith(msg, prefix)) << "message does not start with '" << prefix << "': " << msg;
  for (const std::string& p : parts) EXPECT_TRUE(absl::StrContains(msg, p)) << "'" << p << "' missing from: " << msg;
}

absl::Status OpenStatus(const std::string& path) { return SafetensorsFile::Open(path).status(); }

void ExpectSameBytes(const torch::Tensor& got, const torch::Tensor& want, const std::string& name) {
  EXPECT_EQ(got.scalar_type(), want.scalar_type()) << name;
  EXPECT_EQ(got.sizes(), want.sizes()) << name;
  EXPECT_TRUE(Bytes(got) == Bytes(want)) << name << ": bytes differ";
}

TEST_F(SafetensorsTest, RoundTripIsBitExact) {
  const Tensors tensors = {
      {"f32", torch::randn({97, 3})},                                        // (97, 3)
      {"bf16", torch::randn({257}).to(torch::kBFloat16)},                    // (257)
      {"f16", torch::randn({5, 7, 3}).to(torch::kFloat16)},                  // (5, 7, 3)
      {"i64", torch::randint(-(int64_t{1} << 40), int64_t{1} << 40, {13}, torch::kInt64)},  // (13)
      {"f64", torch::randn({2, 3}, torch::kFloat64)},                        // (2, 3)
      {"i32", torch::randint(-1000, 1000, {7}, torch::kInt32)},              // (7)
      {"i16", torch::randint(-1000, 1000, {3}, torch::kInt16)},              // (3)
      {"i8", torch::randint(-100, 100, {5}, torch::kInt8)},                  // (5)
      {"u8", torch::randint(0, 255, {9}, torch::kUInt8)},                    // (9)
      {"bool", torch::randn({4}) > 0},                                       // (4)
      {"scalar", torch::randn({})},                                          // ()
      {"empty", torch::zeros({0, 5})},                                       // (0, 5)
      {"transposed", torch::randn({4, 6}).t()},                              // (6, 4), not contiguous
  };
  const std::string path = Path("model.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, tensors).ok());
  EXPECT_FALSE(fs::exists(path + ".tmp"));

  // The data section starts 8-byte aligned, as the reference writer pads it.
  const std::string raw = ReadFile(path);
  uint64_t header_len = 0;
  std::memcpy(&header_len, raw.data(), 8);
  EXPECT_EQ(header_len % 8, 0u);

  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->tensors().size(), tensors.size());
  EXPECT_EQ((*file)->metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
  EXPECT_EQ((*file)->tensors().at("bf16").dtype_name, "BF16");
  EXPECT_EQ((*file)->tensors().at("f32").shape, (std::vector<int64_t>{97, 3}));
  EXPECT_EQ((*file)->tensors().at("transposed").shape, (std::vector<int64_t>{6, 4}));

  uint64_t prev_end = 0;
  for (const auto& [name, want] : tensors) {
    // Data is laid out in the order given.
    const TensorInfo& info = (*file)->tensors().at(name);
    EXPECT_EQ(info.begin, prev_end) << name;
    prev_end = info.end;

    absl::StatusOr<torch::Tensor> got = (*file)->Read(name);
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectSameBytes(*got, want, name);
  }
  EXPECT_EQ(raw.size(), 8 + header_len + prev_end);
}

TEST_F(SafetensorsTest, ReadsUnalignedDataSection) {
  // A header of odd length leaves the F32 data at an address that is not 4-byte aligned;
  // reading must still give the exact values.
  const torch::Tensor w = torch::randn({5, 3});  // (5, 3)
  std::string header = R"({"w":{"dtype":"F32","shape":[5,3],"data_offsets":[0,60]}})";
  if (header.size() % 2 == 0) header += " ";
  const std::string path = Path("unaligned.safetensors");
  WriteRaw(path, header, Bytes(w));

  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  absl::StatusOr<torch::Tensor> got = (*file)->Read("w");
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectSameBytes(*got, w, "w");

  torch::Tensor dst = torch::zeros({5, 3}, torch::kFloat64);  // (5, 3)
  ASSERT_TRUE((*file)->ReadInto("w", dst).ok());
  EXPECT_TRUE(torch::equal(dst, w.to(torch::kFloat64)));
}

TEST_F(SafetensorsTest, ReadIntoConvertsBf16ToFp32) {
  const torch::Tensor w = torch::randn({97, 3}).to(torch::kBFloat16);  // (97, 3)
  const std::string path = Path("bf16.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {{"w", w}}).ok());
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();

  // A parameter that requires grad: the copy must not be recorded by autograd.
  torch::Tensor dst = torch::zeros({97, 3}, torch::kFloat32).requires_grad_(true);  // (97, 3)
  const absl::Status s = (*file)->ReadInto("w", dst);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(dst.scalar_type(), torch::kFloat32);
  // bf16 -> fp32 is exact.
  EXPECT_TRUE(torch::equal(dst.detach(), w.to(torch::kFloat32)));
  EXPECT_TRUE(dst.is_leaf());
}

TEST_F(SafetensorsTest, ReadIntoRejectsShapeMismatch) {
  const std::string path = Path("w.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {{"layers.0.w", torch::randn({3, 4})}}).ok());
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  torch::Tensor dst = torch::zeros({4, 3});  // (4, 3)
  ExpectError((*file)->ReadInto("layers.0.w", dst), absl::StatusCode::kInvalidArgument, path,
              {"'layers.0.w' has shape [3, 4] but the model expects [4, 3]"});
  EXPECT_TRUE(torch::equal(dst, torch::zeros({4, 3})));  // untouched
}

TEST_F(SafetensorsTest, ReadIntoRejectsFloatIntegerMismatch) {
  const std::string path = Path("ids.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {{"ids", torch::arange(6, torch::kInt64)}, {"w", torch::randn({6})}}).ok());
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  torch::Tensor f = torch::zeros({6});                   // (6)
  torch::Tensor i = torch::zeros({6}, torch::kInt64);    // (6)
  ExpectError((*file)->ReadInto("ids", f), absl::StatusCode::kInvalidArgument, path,
              {"'ids' has dtype I64 but the model expects a floating tensor (float32)"});
  ExpectError((*file)->ReadInto("w", i), absl::StatusCode::kInvalidArgument, path,
              {"'w' has dtype F32 but the model expects a non-floating tensor (int64)"});
}

TEST_F(SafetensorsTest, ReadOfAbsentTensorIsNotFound) {
  const std::string path = Path("w.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {{"w", torch::randn({2})}}).ok());
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  ExpectError((*file)->Read("lm_head.weight").status(), absl::StatusCode::kNotFound, path, {"'lm_head.weight'"});
  torch::Tensor dst = torch::zeros({2});  // (2)
  ExpectError((*file)->ReadInto("lm_head.weight", dst), absl::StatusCode::kNotFound, path, {"'lm_head.weight'"});
}

TEST_F(SafetensorsTest, WriteRejectsDuplicateNames) {
  const std::string path = Path("dup.safetensors");
  ExpectError(WriteSafetensors(path, {{"w", torch::randn({2})}, {"w", torch::randn({3})}}),
              absl::StatusCode::kInvalidArgument, path, {"duplicate", "'w'"});
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

TEST_F(SafetensorsTest, WriteReportsIoErrors) {
  const std::string path = Path("no_such_dir/model.safetensors");
  const absl::Status s = WriteSafetensors(path, {{"w", torch::randn({2})}});
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(absl::StartsWith(s.message(), path)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), std::strerror(ENOENT))) << s;
}

TEST_F(SafetensorsTest, ShardedCheckpointRoundTrip) {
  // Ten (97,) F32 tensors of 388 bytes: a 1000-byte limit packs two per shard, five shards.
  Tensors tensors;
  for (int i = 0; i < 10; ++i) tensors.emplace_back(absl::StrCat("layers.", i, ".w"), torch::randn({97}));  // (97)
  const std::string dir = Path("ckpt");
  ASSERT_TRUE(WriteSafetensorsCheckpoint(dir, tensors, /*max_shard_bytes=*/1000).ok());

  EXPECT_FALSE(fs::exists(fs::path(dir) / "model.safetensors"));
  for (int i = 1; i <= 5; ++i)
    EXPECT_TRUE(fs::exists(fs::path(dir) / absl::StrCat("model-0000", i, "-of-00005.safetensors"))) << i;
  const nlohmann::json index = nlohmann::json::parse(ReadFile((fs::path(dir) / "model.safetensors.index.json").string()));
  EXPECT_EQ(index["metadata"]["total_size"].get<int64_t>(), 10 * 388);
  ASSERT_EQ(index["weight_map"].size(), 10u);
  EXPECT_EQ(index["weight_map"]["layers.0.w"], "model-00001-of-00005.safetensors");
  EXPECT_EQ(index["weight_map"]["layers.1.w"], "model-00001-of-00005.safetensors");
  EXPECT_EQ(index["weight_map"]["layers.9.w"], "model-00005-of-00005.safetensors");

  absl::StatusOr<SafetensorsCheckpoint> ckpt = SafetensorsCheckpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  std::vector<std::string> names;
  for (const auto& [name, t] : tensors) names.push_back(name);
  std::sort(names.begin(), names.end());
  EXPECT_EQ(ckpt->Names(), names);
  for (const auto& [name, want] : tensors) {
    absl::StatusOr<torch::Tensor> got = ckpt->Read(name);
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectSameBytes(*got, want, name);
    torch::Tensor dst = torch::zeros({97}, torch::kFloat64);  // (97)
    ASSERT_TRUE(ckpt->ReadInto(name, dst).ok());
    EXPECT_TRUE(torch::equal(dst, want.to(torch::kFloat64))) << name;
  }
  ASSERT_NE(ckpt->FileOf("layers.4.w"), nullptr);
  EXPECT_TRUE(absl::EndsWith(ckpt->FileOf("layers.4.w")->path(), "model-00003-of-00005.safetensors"));
  EXPECT_EQ(ckpt->FileOf("nope"), nullptr);

  // Saving again into the same directory as one file leaves no stale index or shards behind,
  // which would otherwise take precedence when the checkpoint is opened.
  const Tensors small = {{"only", torch::randn({3})}};  // (3)
  ASSERT_TRUE(WriteSafetensorsCheckpoint(dir, small).ok());
  EXPECT_TRUE(fs::exists(fs::path(dir) / "model.safetensors"));
  EXPECT_FALSE(fs::exists(fs::path(dir) / "model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(fs::path(dir) / "model-00001-of-00005.safetensors"));
  absl::StatusOr<SafetensorsCheckpoint> again = SafetensorsCheckpoint::Open(dir);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->Names(), std::vector<std::string>{"only"});
}

TEST_F(SafetensorsTest, CheckpointAbsentTensorIsNotFound) {
  const std::string dir = Path("ckpt");
  ASSERT_TRUE(WriteSafetensorsCheckpoint(dir, {{"w", torch::randn({2})}}).ok());
  absl::StatusOr<SafetensorsCheckpoint> ckpt = SafetensorsCheckpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  const std::string want = absl::StrCat("checkpoint ", dir, ": no tensor 'model.norm.weight'");
  torch::Tensor dst = torch::zeros({2});  // (2)
  const absl::Status s = ckpt->ReadInto("model.norm.weight", dst);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.message(), want);
  EXPECT_EQ(ckpt->Read("model.norm.weight").status().message(), want);
}

TEST_F(SafetensorsTest, CheckpointDirWithoutModelFilesIsNotFound) {
  const std::string dir = Path("empty");
  fs::create_directories(dir);
  const absl::Status s = SafetensorsCheckpoint::Open(dir).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.message(), absl::StrCat(dir, ": no model.safetensors or model.safetensors.index.json"));
}

TEST_F(SafetensorsTest, CheckpointIndexPointingToShardWithoutTheTensor) {
  const std::string dir = Path("ckpt");
  fs::create_directories(dir);
  ASSERT_TRUE(WriteSafetensors(dir + "/a.safetensors", {{"x", torch::randn({2})}}).ok());
  ASSERT_TRUE(WriteSafetensors(dir + "/b.safetensors", {{"y", torch::randn({2})}}).ok());
  const std::string index_path = dir + "/model.safetensors.index.json";
  std::ofstream(index_path) << R"({"metadata": {"total_size": 16},
                                   "weight_map": {"x": "a.safetensors", "y": "a.safetensors"}})";
  ExpectError(SafetensorsCheckpoint::Open(dir).status(), absl::StatusCode::kInvalidArgument, index_path,
              {"'y'", "'a.safetensors'", "does not contain it"});
}

TEST_F(SafetensorsTest, CheckpointIndexNamingMissingShard) {
  const std::string dir = Path("ckpt");
  fs::create_directories(dir);
  const std::string index_path = dir + "/model.safetensors.index.json";
  std::ofstream(index_path) << R"({"weight_map": {"x": "gone.safetensors"}})";
  ExpectError(SafetensorsCheckpoint::Open(dir).status(), absl::StatusCode::kNotFound, index_path,
              {dir + "/gone.safetensors"});
}

TEST_F(SafetensorsTest, CheckpointIndexNotJson) {
  const std::string dir = Path("ckpt");
  fs::create_directories(dir);
  const std::string index_path = dir + "/model.safetensors.index.json";
  std::ofstream(index_path) << R"({"weight_map": {"x": )";
  ExpectError(SafetensorsCheckpoint::Open(dir).status(), absl::StatusCode::kInvalidArgument, index_path,
              {"not valid JSON"});
}

// ---- Malformed files -------------------------------------------------------------------------

TEST_F(SafetensorsTest, MissingFileIsNotFound) {
  const std::string path = Path("absent.safetensors");
  ExpectError(OpenStatus(path), absl::StatusCode::kNotFound, path, {});
}

TEST_F(SafetensorsTest, FileTooShort) {
  const std::string path = Path("short.safetensors");
  std::ofstream(path, std::ios::binary) << "abcde";
  ExpectError(OpenStatus(path), absl::StatusCode::kInvalidArgument, path, {"5 bytes", "too short"});
}

TEST_F(SafetensorsTest, HeaderLengthBeyondFile) {
  const std::string path = Path("beyond.safetensors");
  WriteRaw(path, R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", "abcd", /*header_len=*/1000);
  ExpectError(OpenStatus(path), absl::StatusCode::kInvalidArgument, path, {"header length 1000", "beyond"});
}

TEST_F(SafetensorsTest, HeaderLengthAbsurd) {
  const std::string path = Path("absurd.safetensors");
  WriteRaw(path, "{}", "", /*header_len=*/uint64_t{1} << 40);
  ExpectError(OpenStatus(path), absl::StatusCode::kInvalidArgument, path, {"header length 1099511627776", "limit"});
}

TEST_F(SafetensorsTest, HeaderNotJson) {
  const std::string path = Path("garbage.safetensors");
  WriteRaw(path, R"({"w":{"dtype":"F32",)", "");
  ExpectError(OpenStatus(path), absl::StatusCode::kInvalidArgument, path, {"not valid JSON"});
}

TEST_F(SafetensorsTest, HeaderNotObject) {
  const std::string path = Path("array.safetensors");
  WriteRaw(path, "[1, 2]", "");
  ExpectError(OpenStatus(path), absl::StatusCode::kInvalidArgument, path, {"must be a JSON object"});
}

TEST_F(SafetensorsTest, UnknownDtype) {
  const std::string path = Path("fp8.safetensors");
  WriteRaw(path, R"({"w":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]}})", "ab");
  ExpectError(OpenStatus(path), absl::StatusCode::kInvalidArgument, path, {"tensor 'w'", "unknown dtype 'F8_E4M3'"});
}

TEST_F(SafetensorsTest, MalformedEntries) {
  struct Case {
    std::string entry;   // the JSON value of tensor "w"
    std::string phrase;  // what the message must say
  };
  const std::vector<Case> cases = {
      {R"("F32")", "must be a JSON object"},
      {R"({"shape":[1],"data_offsets":[0,4]})", "missing 'dtype'"},
      {R"({"dtype":32,"shape":[1],"data_offsets":[0,4]})", "'dtype' must be a string"},
      {R"({"dtype":"F32","data_offsets":[0,4]})", "missing 'shape'"},
      {R"({"dtype":"F32","shape":"1","data_offsets":[0,4]})", "'shape' must be an array"},
      {R"({"dtype":"F32","shape":[1.5],"data_offsets":[0,4]})", "'shape' must be an array of integers"},
      {R"({"dtype":"F32","shape":[-1],"data_offsets":[0,4]})", "negative dimension"},
      {R"({"dtype":"F32","shape":[1]})", "missing 'data_offsets'"},
      {R"({"dtype":"F32","shape":[1],"data_offsets":[0,4,8]})", "must be [begin, end]"},
      {R"({"dtype":"F32","shape":[1],"data_offsets":[-4,0]})", "must be [begin, end]"},
      {R"({"dtype":"F32","shape":[0],"data_offsets":[4,0]})", "begin > end"},
      {R"({"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]})", "too large"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].entry);
    const std::string path = Path(absl::StrCat("entry", i, ".safetensors"));
    WriteRaw(path, absl::StrCat(R"({"w":)", cases[i].entry, "}"), "abcd");
    ExpectError(OpenStatus(path), absl::StatusCode::kInvalidArgument, path, {"tensor 'w'", cases[i].phrase});
  }
}

TEST_F(SafetensorsTest, MetadataMustMapStringsToStrings) {
  const std::string path = Path("meta.safetensors");
  WriteRaw(path, R"({"__metadata__":{"format":1}})", "");
  ExpectError(OpenStatus(path), absl::StatusCode::kInvalidArgument, path, {"__metadata__", "'format'"});
}

TEST_F(SafetensorsTest, TruncatedData) {
  const std::string path = Path("trunc.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {{"embed", torch::randn({8})}, {"model.norm.weight", torch::randn({96})}}).ok());
  fs::resize_file(path, fs::file_size(path) - 10);
  ExpectError(OpenStatus(path), absl::StatusCode::kInvalidArgument, path, {"tensor 'model.norm.weight'", "truncated"});
}

TEST_F(SafetensorsTest, OffsetsDisagreeWithShape) {
  const std::string path = Path("mismatch.safetensors");
  WriteRaw(path, R"({"model.norm.weight":{"dtype":"F32","shape":[96],"data_offsets":[0,100]}})", std::string(100, 'x'));
  const absl::Status s = OpenStatus(path);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), absl::StrCat(path, ": tensor 'model.norm.weight': data_offsets [0, 100] hold 100 bytes, "
                                            "but shape [96] of F32 needs 384"));
}

TEST_F(SafetensorsTest, OverlappingOffsets) {
  const std::string path = Path("overlap.safetensors");
  WriteRaw(path,
           R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
           R"( "b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})",
           std::string(24, 'x'));
  ExpectError(OpenStatus(path), absl::StatusCode::kInvalidArgument, path, {"tensor 'b'", "overlap", "'a'"});
}

}  // namespace
}  // namespace odyssey::model
