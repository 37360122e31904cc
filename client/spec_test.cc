#include "client/spec.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace odyssey::client {
namespace {

using ::testing::HasSubstr;

TEST(SpecTest, YamlMapsOntoJobSpec) {
  auto spec = ParseJobSpec(R"(
kind: SFT
display_name: tiny on kjv
model: {name: tiny, dtype: float32}
parallel: {world_size: 2, shard_params: true}
optimizer:
  lr: 3e-4
  warmup_steps: 10
data:
  format: kjv
  seq_len: 256
  batch_size: 4
steps: 100
checkpoint: {every_steps: 20}
restart_limit: 2
)", "t.yaml");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->kind(), odyssey::v1::SFT);
  EXPECT_EQ(spec->display_name(), "tiny on kjv");
  EXPECT_EQ(spec->model().name(), "tiny");
  EXPECT_EQ(spec->parallel().world_size(), 2);
  EXPECT_TRUE(spec->parallel().shard_params());
  EXPECT_DOUBLE_EQ(spec->optimizer().lr(), 3e-4);
  EXPECT_EQ(spec->data().seq_len(), 256);
  EXPECT_EQ(spec->steps(), 100);
  EXPECT_EQ(spec->checkpoint().every_steps(), 20);
  EXPECT_EQ(spec->restart_limit(), 2);
}

// The RL session example parses: kind RL_SESSION and the rl block.
TEST(SpecTest, RlSessionExample) {
  auto spec = LoadJobSpec(std::string(ODYSSEY_SOURCE_DIR) + "/client/examples/rl-session.yaml");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->kind(), odyssey::v1::RL_SESSION);
  EXPECT_EQ(spec->rl().idle_timeout_seconds(), 1800);
  EXPECT_EQ(spec->data().seq_len() * spec->data().batch_size(), 4096);
  EXPECT_EQ(spec->steps(), 0);
}

TEST(SpecTest, JsonMapsOntoJobSpec) {
  auto spec = ParseJobSpec(R"({"model": {"name": "tiny"}, "optimizer": {"lr": 0.001}, "steps": 5,
                               "data": {"seqLen": 64}})", "t.json");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->steps(), 5);
  EXPECT_EQ(spec->data().seq_len(), 64);
}

TEST(SpecTest, ErrorsNameFileAndField) {
  struct Case {
    std::string text, want;
  };
  for (const Case& c : std::vector<Case>{
           {"optimizer: {lrr: 1}", "t.yaml: optimizer.lrr: unknown field"},
           {"stepz: 1", "t.yaml: stepz: unknown field"},
           {"steps: 1.5", "t.yaml: steps: invalid value"},
           {"optimizer: {lr: fast}", "t.yaml: optimizer.lr: invalid value"},
           {"kind: XX", "t.yaml: kind: invalid value"},
           {"- a\n- b", "t.yaml: must be a mapping"},
           {"model: {name: [unclosed", "t.yaml: not valid YAML"},
           {"{\"steps\": }", "t.yaml:"},
       }) {
    auto spec = ParseJobSpec(c.text, "t.yaml");
    ASSERT_FALSE(spec.ok()) << c.text;
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(spec.status().message()), HasSubstr(c.want)) << c.text;
  }
  EXPECT_EQ(LoadJobSpec("/nonexistent/spec.yaml").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace odyssey::client
