#include "model/config.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "common/files.h"

namespace odyssey::model {
namespace {

TEST(ConfigTest, NamedShapesHaveTheirPublishedSizes) {
  // Parameter counts of the published models (embeddings counted once when tied).
  EXPECT_NEAR(NamedShape("llama-3.2-1b")->NumParameters() / 1e9, 1.236, 0.002);
  EXPECT_NEAR(NamedShape("llama-3.2-3b")->NumParameters() / 1e9, 3.213, 0.002);
  EXPECT_NEAR(NamedShape("llama-3.1-8b")->NumParameters() / 1e9, 8.030, 0.002);
  for (const auto& name : NamedShapeNames()) EXPECT_TRUE(NamedShape(name)->Validate().ok()) << name;
}

TEST(ConfigTest, UnknownShapeNamesTheChoices) {
  auto c = NamedShape("llama-9000");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("llama-3.2-3b"), std::string::npos);
}

TEST(ConfigTest, ParsesQwen3WithHeadDimAndLlama3Scaling) {
  auto q = ParseHfConfig(R"({"model_type":"qwen3","vocab_size":257,"hidden_size":96,"intermediate_size":160,
    "num_hidden_layers":5,"num_attention_heads":3,"num_key_value_heads":1,"head_dim":48,"tie_word_embeddings":true})",
                         "q.json");
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->HeadDim(), 48);
  EXPECT_TRUE(q->QkNorm());
  EXPECT_FALSE(q->QkvBias());
  auto l = ParseHfConfig(R"({"model_type":"llama","vocab_size":10,"hidden_size":8,"intermediate_size":16,
    "num_hidden_layers":1,"num_attention_heads":2,"rope_scaling":{"rope_type":"llama3","factor":32.0,
    "low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}})",
                         "l.json");
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_TRUE(l->rope_scaling.enabled);
  EXPECT_EQ(l->rope_scaling.factor, 32.0);
  EXPECT_EQ(l->num_key_value_heads, 2);  // defaults to num_attention_heads
  // The exported config parses back to the same model.
  auto back = ParseHfConfig(ToHfConfigJson(*l, "bfloat16"), "export");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->NumParameters(), l->NumParameters());
  EXPECT_TRUE(back->rope_scaling.enabled);
}

TEST(ConfigTest, BadConfigsNameFieldAndRule) {
  struct Case {
    const char* json;
    const char* expect;
  } cases[] = {
      {"[1,2]", "not a JSON object"},
      {R"({"model_type":"gpt2"})", "model_type 'gpt2' is not supported"},
      {R"({"model_type":"llama","hidden_size":8})", "missing field 'vocab_size'"},
      {R"({"model_type":"llama","vocab_size":"x"})", "'vocab_size' must be an integer"},
      {R"({"model_type":"llama","vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":1,
          "num_attention_heads":3,"num_key_value_heads":2,"head_dim":4})",
       "num_key_value_heads (2) must divide num_attention_heads (3)"},
      {R"({"model_type":"llama","vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":0,
          "num_attention_heads":2})",
       "num_hidden_layers (0) must be > 0"},
      {R"({"model_type":"llama","vocab_size":10,"hidden_size":10,"intermediate_size":16,"num_hidden_layers":1,
          "num_attention_heads":4})",
       "must divide hidden_size"},
      {R"({"model_type":"llama","vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":1,
          "num_attention_heads":2,"rope_scaling":{"rope_type":"yarn"}})",
       "rope_type 'yarn' is not supported"},
  };
  for (const auto& c : cases) {
    auto r = ParseHfConfig(c.json, "cfg.json");
    ASSERT_FALSE(r.ok()) << c.json;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(c.expect), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find("cfg.json"), std::string::npos) << r.status().message();
  }
}

// A config field whose value changes the math of something the model does not implement is
// refused with the field, its value and what is supported; the values the model does compute
// load (what transformers writes for Llama and Qwen).
TEST(ConfigTest, FieldsThatChangeTheMathAreRefusedNotIgnored) {
  const std::string base = R"("vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":1,
      "num_attention_heads":2)";
  struct Case {
    std::string json;
    const char* expect;  // nullptr: loads
  } cases[] = {
      {R"({"model_type":"llama",)" + base + R"(,"hidden_act":"gelu_pytorch_tanh"})",
       "hidden_act 'gelu_pytorch_tanh' is not supported: the MLP is SwiGLU (silu)"},
      {R"({"model_type":"qwen3",)" + base + R"(,"hidden_activation":"gelu"})", "hidden_activation 'gelu'"},
      {R"({"model_type":"qwen2",)" + base + R"(,"use_sliding_window":true,"sliding_window":4096})",
       "use_sliding_window true is not supported"},
      {R"({"model_type":"qwen3",)" + base + R"(,"layer_types":["full_attention","sliding_attention"]})",
       "layer_types entry \"sliding_attention\" is not supported"},
      {R"({"model_type":"llama",)" + base + R"(,"sliding_window":4096})", "sliding_window (4096) is not supported"},
      {R"({"model_type":"llama",)" + base + R"(,"attention_dropout":0.1})", "attention_dropout (0.1) is not supported"},
      {R"({"model_type":"llama",)" + base + R"(,"partial_rotary_factor":0.5})",
       "partial_rotary_factor (0.5) is not supported"},
      {R"({"model_type":"llama",)" + base + R"(,"final_logit_softcapping":30.0})",
       "final_logit_softcapping (30.0) is not supported"},
      {R"({"model_type":"llama",)" + base + R"(,"rope_scaling":{"rope_type":"dynamic","factor":2.0}})",
       "rope_scaling.rope_type 'dynamic' is not supported (default, llama3)"},
      {R"({"model_type":"llama",)" + base +
           R"(,"hidden_act":"silu","attention_dropout":0.0,"partial_rotary_factor":1.0,"final_logit_softcapping":null})",
       nullptr},
      {R"({"model_type":"qwen2",)" + base +
           R"(,"use_sliding_window":false,"sliding_window":null,"layer_types":["full_attention"]})",
       nullptr},
  };
  for (const auto& c : cases) {
    auto r = ParseHfConfig(c.json, "cfg.json");
    if (c.expect == nullptr) {
      EXPECT_TRUE(r.ok()) << c.json << ": " << r.status();
      continue;
    }
    ASSERT_FALSE(r.ok()) << c.json;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(c.expect), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find("cfg.json"), std::string::npos) << r.status().message();
  }
}

// The hybrid family's config.json: written and read back field for field (layer pattern and
// indexer settings included); unknown fields, other models' MoE fields and invalid values are
// refused by name (its own MoE fields: moe_test).
TEST(ConfigTest, HybridConfigRoundTripsAndRefusesWhatItCannotCompute) {
  absl::StatusOr<ModelConfig> tiny = NamedShape("hybrid-tiny");
  ASSERT_TRUE(tiny.ok()) << tiny.status();
  ModelConfig c = *tiny;
  c.hybrid.layer_pattern = "KD";
  c.hybrid.kda_chunk_size = 32;
  c.hybrid.kda_gate_lower_bound = -3.5;
  c.hybrid.indexer_stage = IndexerStage::kDenseWarmup;
  c.hybrid.indexer_loss_weight = 0.25;
  c.hybrid.index_top_k = 2048;
  const std::string text = ToHfConfigJson(c, "bfloat16");
  absl::StatusOr<ModelConfig> back = ParseHfConfig(text, "h.json");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->IsHybrid());
  EXPECT_EQ(ToHfConfigJson(*back, "bfloat16"), text);
  EXPECT_EQ(back->hybrid.layer_pattern, "KD");
  EXPECT_EQ(back->hybrid.kda_chunk_size, 32);
  EXPECT_EQ(back->hybrid.kda_gate_lower_bound, -3.5);
  EXPECT_EQ(back->hybrid.indexer_stage, IndexerStage::kDenseWarmup);
  EXPECT_EQ(back->hybrid.indexer_loss_weight, 0.25);
  EXPECT_EQ(back->LayerKind(0), 'K');
  EXPECT_EQ(back->LayerKind(3), 'D');
  EXPECT_EQ(back->NumParameters(), c.NumParameters());

  // hybrid-3b: 28 layers of KKKD = 21 KDA + 7 DSA.
  absl::StatusOr<ModelConfig> big = NamedShape("hybrid-3b");
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(big->NumLayersOfKind('K'), 21);
  EXPECT_EQ(big->NumLayersOfKind('D'), 7);
  EXPECT_EQ(big->hybrid.index_top_k, 2048);

  auto refused = [&](const std::string& from, const std::string& to, const std::string& needle) {
    std::string bad = text;
    const size_t at = bad.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    bad.replace(at, from.size(), to);
    absl::StatusOr<ModelConfig> r = ParseHfConfig(bad, "h.json");
    ASSERT_FALSE(r.ok()) << to;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status();
  };
  refused("\"layer_pattern\": \"KD\"", "\"layer_pattern\": \"KXD\"", "layer_pattern 'KXD'");
  refused("\"layer_pattern\": \"KD\"", "\"layer_pattern\": \"KKD\"", "multiple of the length of layer_pattern");
  refused("\"kda_chunk_size\": 32", "\"kda_chunk_size\": 48", "kda_chunk_size (48) must be 32 or 64");
  refused("\"kda_gate_lower_bound\": -3.5", "\"kda_gate_lower_bound\": 0.5", "kda_gate_lower_bound");
  refused("\"index_top_k\": 2048", "\"index_top_k\": 2050", "index_top_k (2050)");
  refused("\"indexer_stage\": \"dense_warmup\"", "\"indexer_stage\": \"later\"", "indexer_stage 'later'");
  refused("\"indexer_loss_weight\": 0.25", "\"indexer_loss_weight\": -1", "indexer_loss_weight");
  refused("\"kda_num_heads\": 4", "\"kda_num_heads\": 4, \"use_rope\": true", "field 'use_rope'");
  refused("\"kda_num_heads\": 4", "\"kda_num_heads\": 4, \"n_routed_experts\": 16", "n_routed_experts is not supported");
  refused("\"kda_num_heads\": 4", "\"kda_num_heads\": \"four\"", "'kda_num_heads' must be an integer");
}

// What a job may change of the model it names: the indexer stage (hybrid models with DSA
// layers), the layer count (named shapes), the KDA chunk size (hybrid models with KDA layers);
// refusals name the field and the rule.
TEST(ConfigTest, OverridesActOrAreRefusedByName) {
  absl::StatusOr<ModelConfig> warm = ResolveModelConfig("hybrid-tiny", ModelOverrides{0, "dense_warmup"}, "spec.");
  ASSERT_TRUE(warm.ok()) << warm.status();
  EXPECT_EQ(warm->hybrid.indexer_stage, IndexerStage::kDenseWarmup);
  absl::StatusOr<ModelConfig> plain = ResolveModelConfig("hybrid-tiny", ModelOverrides{2, ""});
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->hybrid.indexer_stage, IndexerStage::kSparse);  // "" leaves the config's
  EXPECT_EQ(plain->num_hidden_layers, 2);
  ModelConfig c = *warm;
  ASSERT_TRUE(SetIndexerStage("f", "sparse", &c).ok());
  EXPECT_EQ(c.hybrid.indexer_stage, IndexerStage::kSparse);
  ASSERT_TRUE(SetIndexerStage("f", "", &c).ok());
  EXPECT_EQ(c.hybrid.indexer_stage, IndexerStage::kSparse);
  auto fails = [](absl::StatusOr<ModelConfig> r, const std::string& text) {
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(text), std::string::npos) << r.status();
  };
  fails(ResolveModelConfig("hybrid-tiny", ModelOverrides{0, "Sparse"}, "spec.model."),
        "spec.model.indexer_stage: 'Sparse' is not one of dense_warmup, sparse");
  // A long or non-UTF-8 value is not echoed back.
  absl::StatusOr<ModelConfig> long_value =
      ResolveModelConfig("hybrid-tiny", ModelOverrides{0, std::string(4000, '\xff')}, "spec.model.");
  fails(long_value, "spec.model.indexer_stage: (4000 bytes) is not one of");
  EXPECT_LT(long_value.status().message().size(), 200u);
  fails(ResolveModelConfig("hybrid-tiny", ModelOverrides{0, "\xff"}), "indexer_stage: '\\xff' is not one of");
  fails(ResolveModelConfig("tiny", ModelOverrides{0, "sparse"}, "--"),
        "--indexer_stage (sparse) acts on DSA layers' indexers; the model has no DSA layers");
  // hybrid-tiny cut to its first layer (KDA) has no DSA layer left.
  fails(ResolveModelConfig("hybrid-tiny", ModelOverrides{1, "dense_warmup"}), "the model has no DSA layers");
  fails(ResolveModelConfig("tiny", ModelOverrides{-1, ""}), "num_layers (-1) must be >= 0");
  const auto dir = std::filesystem::temp_directory_path() / "odyssey_config_test_overrides";
  std::filesystem::create_directories(dir);
  ASSERT_TRUE(WriteFileAtomically((dir / "config.json").string(), ToHfConfigJson(*warm, "float32")).ok());
  absl::StatusOr<ModelConfig> folder = ResolveModelConfig(dir.string(), ModelOverrides{0, "sparse"});
  ASSERT_TRUE(folder.ok()) << folder.status();
  EXPECT_EQ(folder->hybrid.indexer_stage, IndexerStage::kSparse);
  fails(ResolveModelConfig(dir.string(), ModelOverrides{2, ""}), "num_layers can only cut a named shape");
  // The chunk size does not change the weights: a checkpoint folder takes it too.
  absl::StatusOr<ModelConfig> folder32 = ResolveModelConfig(dir.string(), ModelOverrides{0, "", 32});
  ASSERT_TRUE(folder32.ok()) << folder32.status();
  EXPECT_EQ(folder32->hybrid.kda_chunk_size, 32);
  std::filesystem::remove_all(dir);
  ASSERT_EQ(warm->hybrid.kda_chunk_size, 64);  // the named shape's own; 0 leaves it
  for (int64_t C : {32, 64}) {
    absl::StatusOr<ModelConfig> chunked = ResolveModelConfig("hybrid-tiny", ModelOverrides{0, "", C});
    ASSERT_TRUE(chunked.ok()) << chunked.status();
    EXPECT_EQ(chunked->hybrid.kda_chunk_size, C);
  }
  fails(ResolveModelConfig("hybrid-tiny", ModelOverrides{0, "", 48}, "--"), "--kda_chunk_size (48) must be 32 or 64");
  fails(ResolveModelConfig("hybrid-tiny", ModelOverrides{0, "", -32}), "kda_chunk_size (-32) must be 32 or 64");
  fails(ResolveModelConfig("tiny", ModelOverrides{0, "", 32}, "spec."),
        "spec.kda_chunk_size: the model has no KDA layers");
}

}  // namespace
}  // namespace odyssey::model
