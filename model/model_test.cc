#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <cmath>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "kernels/dsa.h"
#include "model/causal_lm.h"
#include "model/decode.h"
#include "model/hybrid.h"
#include "model/safetensors.h"
#include "model/weights.h"

namespace odyssey::model {
namespace {

ModelConfig SmallConfig(Architecture arch) {
  ModelConfig c;
  c.architecture = arch;
  c.vocab_size = 97;
  c.hidden_size = 48;
  c.intermediate_size = 80;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 256;
  c.tie_word_embeddings = arch != Architecture::kQwen2;
  return c;
}

TEST(ModelTest, ParameterNamesAreHuggingFaceNames) {
  CausalLM m(SmallConfig(Architecture::kQwen3));
  std::set<std::string> names;
  for (auto& p : m->named_parameters()) names.insert(p.key());
  for (const char* n : {"model.embed_tokens.weight", "model.layers.1.self_attn.q_proj.weight",
                        "model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight",
                        "model.layers.0.mlp.down_proj.weight", "model.layers.1.post_attention_layernorm.weight",
                        "model.norm.weight"}) {
    EXPECT_TRUE(names.count(n)) << n;
  }
  EXPECT_FALSE(names.count("lm_head.weight"));  // tied
  int64_t total = 0;
  for (auto& p : m->parameters()) total += p.numel();
  EXPECT_EQ(total, m->config().NumParameters());
  CausalLM q2(SmallConfig(Architecture::kQwen2));
  std::set<std::string> q2names;
  for (auto& p : q2->named_parameters()) q2names.insert(p.key());
  EXPECT_TRUE(q2names.count("model.layers.0.self_attn.q_proj.bias"));
  EXPECT_FALSE(q2names.count("model.layers.0.self_attn.o_proj.bias"));
  EXPECT_TRUE(q2names.count("lm_head.weight"));
}

TEST(ModelTest, PackedDocumentsEqualSeparateSequences) {
  torch::manual_seed(0);
  CausalLM m(SmallConfig(Architecture::kLlama));
  m->InitRandom(3, 0.1);
  torch::Tensor a = torch::randint(0, 97, {1, 7}, torch::kInt64);
  torch::Tensor b = torch::randint(0, 97, {1, 12}, torch::kInt64);
  ForwardInputs packed;
  packed.input_ids = torch::cat({a, b}, 1);  // (1, 19)
  packed.position_ids = torch::cat({torch::arange(7), torch::arange(12)}).unsqueeze(0);
  std::vector<std::vector<int64_t>> lens = {{7, 12}};
  packed.doc_lens = &lens;
  torch::Tensor hp = m->Hidden(packed);
  ForwardInputs ia, ib;
  ia.input_ids = a;
  ib.input_ids = b;
  torch::Tensor ha = m->Hidden(ia), hb = m->Hidden(ib);
  EXPECT_TRUE(torch::allclose(hp.narrow(1, 0, 7), ha, 1e-5, 1e-5));
  EXPECT_TRUE(torch::allclose(hp.narrow(1, 7, 12), hb, 1e-5, 1e-5));
  // Without doc_lens the second document would see the first: the outputs must differ.
  ForwardInputs unpacked = packed;
  unpacked.doc_lens = nullptr;
  EXPECT_FALSE(torch::allclose(m->Hidden(unpacked).narrow(1, 7, 12), hb, 1e-3, 1e-3));
}

// The decoding path (Prefill + Decode through the KV cache) gives the logits of the training
// forward on the whole sequence at every position: rows of different prompt lengths prefilled
// together right-padded, then decoded one token at a time at each row's own position.
TEST(ModelTest, KvCacheDecodingEqualsTheFullForward) {
  // The last pass carries LoRA adapters on every projection (B nonzero, so they act): a LoRA
  // session samples from its adapted weights.
  const std::vector<std::pair<Architecture, bool>> passes = {
      {Architecture::kLlama, false}, {Architecture::kQwen2, false}, {Architecture::kQwen3, false}, {Architecture::kLlama, true}};
  for (const auto& [arch, lora] : passes) {
    SCOPED_TRACE(absl::StrCat(static_cast<int>(arch), lora ? " with LoRA" : ""));
    CausalLM m(SmallConfig(arch));
    m->InitRandom(5, 0.1);
    if (lora) {
      LoraConfig adapters;
      adapters.rank = 2;
      adapters.alpha = 4;
      ASSERT_TRUE(AttachLora(*m, adapters, 3).ok());
      torch::NoGradGuard no_grad;
      for (auto& p : m->named_parameters())
        if (p.key().find(".lora_B.") != std::string::npos) p.value().normal_(0, 0.2);
    }
    torch::NoGradGuard no_grad;
    const std::vector<int64_t> prompt_len = {5, 9, 2};
    const int64_t B = 3, steps = 4, P = 9;
    torch::Tensor seq = torch::randint(0, 97, {B, P + steps}, torch::kInt64);  // each row's whole sequence
    torch::Tensor padded = seq.narrow(1, 0, P).clone();
    for (int64_t b = 0; b < B; ++b) padded[b].narrow(0, prompt_len[b], P - prompt_len[b]).fill_(0);  // right padding
    KvCache cache = NewKvCache(*m, B, P + steps);
    torch::Tensor h = Prefill(*m, padded, cache);  // (B, P, hidden)
    for (int64_t b = 0; b < B; ++b) {
      const int64_t L = prompt_len[b];
      ForwardInputs row;
      row.input_ids = seq[b].narrow(0, 0, L + steps).unsqueeze(0);
      torch::Tensor full = m->Logits(row)[0];  // (L + steps, vocab)
      torch::Tensor prefilled = torch::matmul(h[b].narrow(0, 0, L), m->HeadWeight().t());
      EXPECT_TRUE(torch::allclose(prefilled, full.narrow(0, 0, L), 1e-5, 1e-5)) << "prefill, row " << b;
    }
    torch::Tensor pos = torch::tensor(prompt_len, torch::kInt64);  // (B,)
    for (int64_t t = 0; t < steps; ++t) {
      torch::Tensor ids = seq.gather(1, pos.unsqueeze(1));  // (B, 1): each row's token at its position
      torch::Tensor logits = torch::matmul(Decode(*m, ids, pos, cache).squeeze(1), m->HeadWeight().t());  // (B, V)
      for (int64_t b = 0; b < B; ++b) {
        ForwardInputs row;
        row.input_ids = seq[b].narrow(0, 0, pos[b].item<int64_t>() + 1).unsqueeze(0);
        torch::Tensor want = m->Logits(row)[0][-1];
        EXPECT_TRUE(torch::allclose(logits[b], want, 1e-5, 1e-5))
            << "decode step " << t << ", row " << b << ": max diff " << (logits[b] - want).abs().max().item<float>();
      }
      pos = pos + 1;
    }
  }
}

TEST(ModelTest, MathAndSdpaBackendsAgree) {
  torch::manual_seed(1);
  CausalLM m(SmallConfig(Architecture::kQwen3));
  m->InitRandom(5, 0.1);
  ForwardInputs in;
  in.input_ids = torch::randint(0, 97, {2, 33}, torch::kInt64);
  m->set_attention_backend(kernels::MakeAttentionBackend("math").value());
  torch::Tensor a = m->Logits(in);
  m->set_attention_backend(kernels::MakeAttentionBackend("sdpa").value());
  torch::Tensor b = m->Logits(in);
  EXPECT_LT((a - b).abs().max().item<double>(), 1e-4);
  EXPECT_FALSE(kernels::MakeAttentionBackend("flash9").ok());
}

TEST(ModelTest, OutputIsCausal) {
  CausalLM m(SmallConfig(Architecture::kLlama));
  m->InitRandom(7, 0.1);
  torch::Tensor ids = torch::randint(0, 97, {1, 20}, torch::kInt64);
  ForwardInputs in;
  in.input_ids = ids;
  torch::Tensor base = m->Logits(in);
  torch::Tensor changed = ids.clone();
  changed.index_put_({0, 15}, (ids.index({0, 15}) + 1) % 97);
  in.input_ids = changed;
  torch::Tensor other = m->Logits(in);
  EXPECT_TRUE(torch::equal(base.narrow(1, 0, 15), other.narrow(1, 0, 15)));
  EXPECT_FALSE(torch::allclose(base.narrow(1, 15, 5), other.narrow(1, 15, 5)));
}

// Chunked normalization (3 rows per chunk over 35 rows) equals one chunk bitwise, and its
// hand-written backward equals autograd through the plain formula.
TEST(ModelTest, ChunkedRMSNormMatchesPlainFormula) {
  torch::manual_seed(3);
  RMSNorm whole(16, 1e-6), chunked(16, 1e-6);
  chunked->set_chunk_elements(3 * 16);
  torch::Tensor w = torch::rand({16}) + 0.5;
  whole->weight.data().copy_(w);
  chunked->weight.data().copy_(w);
  torch::Tensor x = torch::randn({5, 7, 16});
  torch::Tensor a = x.clone().requires_grad_(true), b = x.clone().requires_grad_(true);
  torch::Tensor g = torch::randn({5, 7, 16});
  torch::Tensor ya = whole(a), yb = chunked(b);
  EXPECT_TRUE(torch::equal(ya, yb));
  yb.backward(g);
  // Reference: autograd through the formula.
  torch::Tensor c = x.clone().requires_grad_(true), wr = w.clone().requires_grad_(true);
  torch::Tensor ref = wr * (c * torch::rsqrt(c.pow(2).mean(-1, true) + 1e-6));
  ref.backward(g);
  EXPECT_TRUE(torch::allclose(yb, ref, 1e-6, 1e-6));
  EXPECT_LT((b.grad() - c.grad()).abs().max().item<double>(), 1e-5);
  EXPECT_LT((chunked->weight.grad() - wr.grad()).abs().max().item<double>(), 1e-4);
  EXPECT_GT(c.grad().abs().max().item<double>(), 0.01);
}

TEST(ModelTest, LoadModelRejectsUnknownNamesAndBadDirs) {
  auto r = LoadModel("no-such-model", torch::kFloat32, torch::kCPU);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("neither a named shape"), std::string::npos);
  auto dir = std::filesystem::temp_directory_path() / "odyssey_model_test_empty";
  std::filesystem::create_directories(dir);
  auto d = LoadModel(dir.string(), torch::kFloat32, torch::kCPU);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("config.json"), std::string::npos) << d.status();
  std::filesystem::remove_all(dir);
}

TEST(ModelTest, MissingAndMisshapenTensorsAreNamed) {
  auto dir = std::filesystem::temp_directory_path() / "odyssey_model_test_ckpt";
  std::filesystem::remove_all(dir);
  ModelConfig c = SmallConfig(Architecture::kLlama);
  CausalLM m(c);
  m->InitRandom(1);
  ASSERT_TRUE(SaveHfCheckpoint(m, dir.string(), {torch::kFloat32}).ok());
  // A model with one more layer than the checkpoint holds: the missing tensor is named.
  c.num_hidden_layers = 3;
  CausalLM bigger(c);
  absl::Status s = LoadHfWeights(bigger, dir.string());
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("model.layers.2."), std::string::npos) << s;
  // A wider model: the shape mismatch names the tensor and both shapes.
  c = SmallConfig(Architecture::kLlama);
  c.intermediate_size = 96;
  CausalLM wider(c);
  s = LoadHfWeights(wider, dir.string());
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("mlp"), std::string::npos) << s;
  EXPECT_NE(s.message().find("96"), std::string::npos) << s;
  std::filesystem::remove_all(dir);
}

// A saved folder is a complete model: the base folder's tokenizer and generation files come
// along byte for byte, its weights and config do not, and a named shape (no folder) adds none.
TEST(ModelTest, SavedFolderCarriesTheBaseModelsTokenizerAndGenerationFiles) {
  const auto root = std::filesystem::temp_directory_path() / "odyssey_model_test_base_files";
  std::filesystem::remove_all(root);
  const auto base = root / "base", out = root / "out", plain = root / "plain";
  std::filesystem::create_directories(base);
  auto write = [](const std::filesystem::path& p, const std::string& text) { std::ofstream(p, std::ios::binary) << text; };
  const std::map<std::string, std::string> extras = {
      {"tokenizer.json", "{\"version\": \"1.0\", \"model\": {\"type\": \"BPE\"}}"},
      {"tokenizer_config.json", "{\"chat_template\": \"{{ messages }}\"}"},
      {"special_tokens_map.json", "{\"eos_token\": \"</s>\"}"},
      {"tokenizer.model", std::string("\x00\x01sentencepiece\xff", 16)},
      {"vocab.json", "{\"a\": 0}"},
      {"merges.txt", "#version: 0.2\na b\n"},
      {"chat_template.jinja", "{% for m in messages %}{{ m.content }}{% endfor %}"},
      {"generation_config.json", "{\"eos_token_id\": 2, \"temperature\": 0.6}"}};
  for (const auto& [name, text] : extras) write(base / name, text);
  write(base / "config.json", "not this one");
  write(base / "model.safetensors", "nor this");
  write(base / "README.md", "nor anything else");
  CausalLM m(SmallConfig(Architecture::kLlama));
  m->InitRandom(1);
  SaveOptions save;
  save.dtype = torch::kFloat32;
  save.base_dir = base.string();
  ASSERT_TRUE(SaveHfCheckpoint(m, out.string(), save).ok());
  auto read = [](const std::filesystem::path& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  for (const auto& [name, text] : extras) EXPECT_EQ(read(out / name), text) << name;
  EXPECT_NE(read(out / "config.json"), "not this one");
  EXPECT_NE(read(out / "model.safetensors"), "nor this");
  EXPECT_FALSE(std::filesystem::exists(out / "README.md"));
  EXPECT_FALSE(std::filesystem::exists(out / "vocab.txt"));  // the base has none
  save.base_dir = "tiny";  // a named shape
  ASSERT_TRUE(SaveHfCheckpoint(m, plain.string(), save).ok());
  std::set<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(plain)) names.insert(e.path().filename().string());
  EXPECT_EQ(names, (std::set<std::string>{"config.json", "model.safetensors"}));
  std::filesystem::remove_all(root);
}

// --- The hybrid family (model/hybrid.h) ---

ModelConfig TinyHybrid(IndexerStage stage = IndexerStage::kSparse) {
  ModelConfig c = NamedShape("hybrid-tiny").value();
  c.vocab_size = 61;
  c.hybrid.index_top_k = 8;  // 2 pools + the tail: rows longer than 11 are sparse
  c.hybrid.indexer_stage = stage;
  return c;
}

torch::Tensor HybridHidden(CausalLM& m, const torch::Tensor& ids, const std::vector<std::vector<int64_t>>* docs = nullptr) {
  ForwardInputs in;
  in.input_ids = ids;
  in.doc_lens = docs;
  return m->Hidden(in);
}

TEST(HybridModelTest, ParameterNamesCountsAndFp32Gates) {
  const ModelConfig c = NamedShape("hybrid-tiny").value();
  CausalLM m(c);
  std::set<std::string> names;
  int64_t total = 0, indexers = 0;
  for (auto& p : m->named_parameters()) {
    names.insert(p.key());
    total += p.value().numel();
    if (p.key().find(".indexer.") != std::string::npos) indexers += p.value().numel();
  }
  EXPECT_EQ(total, c.NumParameters());
  EXPECT_EQ(indexers, c.IndexerParameters());  // what the dense warm-up trains (planner/)
  EXPECT_GT(indexers, 0);
  for (const char* n : {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_conv1d.weight",
                        "model.layers.0.self_attn.A_log", "model.layers.0.self_attn.dt_bias",
                        "model.layers.0.self_attn.f_a_proj.weight", "model.layers.0.self_attn.f_b_proj.weight",
                        "model.layers.0.self_attn.b_proj.weight", "model.layers.0.self_attn.g_b_proj.weight",
                        "model.layers.0.self_attn.o_norm.weight", "model.layers.2.self_attn.o_proj.weight",
                        "model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.indexer.wq.weight",
                        "model.layers.3.self_attn.indexer.wk.weight", "model.layers.3.self_attn.indexer.k_norm.bias",
                        "model.layers.3.self_attn.indexer.weights_proj.weight",
                        "model.layers.3.self_attn.indexer.pool_gate.weight",
                        "model.layers.3.self_attn.indexer.pool_bias", "model.layers.3.mlp.down_proj.weight"}) {
    EXPECT_TRUE(names.count(n)) << n;
  }
  EXPECT_FALSE(names.count("model.layers.3.self_attn.A_log"));  // a DSA layer
  m->InitRandom(3);
  m->to(torch::kBFloat16);
  EXPECT_EQ(m->model->layer_list[0]->kda->A_log.scalar_type(), torch::kFloat32);
  EXPECT_EQ(m->model->layer_list[0]->kda->dt_bias.scalar_type(), torch::kFloat32);
  EXPECT_EQ(m->model->layer_list[0]->kda->q_proj->weight.scalar_type(), torch::kBFloat16);
  // The spec's init: A_log = log U(1, 16); dt = softplus(dt_bias) in [1e-3, 0.1].
  torch::Tensor a = m->model->layer_list[1]->kda->A_log;
  EXPECT_GE(a.min().item<double>(), 0.0);
  EXPECT_LE(a.max().item<double>(), std::log(16.0) + 1e-6);
  torch::Tensor dt = torch::softplus(m->model->layer_list[1]->kda->dt_bias);
  EXPECT_GE(dt.min().item<double>(), 1e-3 * 0.999);
  EXPECT_LE(dt.max().item<double>(), 0.1 * 1.001);
}

// Spec 2.4: a row of at most index_top_k + 3 tokens selects every earlier key, so the sparse
// stage equals the dense warm-up's dense causal attention; a longer row does not.
TEST(HybridModelTest, ShortRowsAreDenseAttentionLongRowsAreSparse) {
  CausalLM sparse(TinyHybrid(IndexerStage::kSparse));
  sparse->InitRandom(7, 0.1);
  CausalLM dense(TinyHybrid(IndexerStage::kDenseWarmup));
  dense->InitRandom(7, 0.1);
  torch::NoGradGuard no_grad;
  torch::manual_seed(1);
  torch::Tensor short_ids = torch::randint(0, 61, {2, 11}, torch::kInt64);
  EXPECT_LT((HybridHidden(sparse, short_ids) - HybridHidden(dense, short_ids)).abs().max().item<double>(), 1e-5);
  torch::Tensor long_ids = torch::randint(0, 61, {2, 40}, torch::kInt64);
  EXPECT_GT((HybridHidden(sparse, long_ids) - HybridHidden(dense, long_ids)).abs().max().item<double>(), 1e-4);
}

TEST(HybridModelTest, PackedDocumentsEqualSeparateSequencesAndOutputIsCausal) {
  CausalLM m(TinyHybrid());
  m->InitRandom(5, 0.1);
  torch::NoGradGuard no_grad;
  torch::manual_seed(2);
  torch::Tensor ids = torch::randint(0, 61, {1, 37}, torch::kInt64);
  const std::vector<std::vector<int64_t>> docs = {{21, 16}};
  torch::Tensor packed = HybridHidden(m, ids, &docs);
  torch::Tensor first = HybridHidden(m, ids.narrow(1, 0, 21));
  torch::Tensor second = HybridHidden(m, ids.narrow(1, 21, 16));
  EXPECT_LT((packed.narrow(1, 0, 21) - first).abs().max().item<double>(), 1e-5);
  EXPECT_LT((packed.narrow(1, 21, 16) - second).abs().max().item<double>(), 1e-5);
  // Changing token 30 changes nothing before it.
  torch::Tensor other = ids.clone();
  other[0][30] = (other[0][30].item<int64_t>() + 1) % 61;
  torch::Tensor a = HybridHidden(m, ids), b = HybridHidden(m, other);
  EXPECT_EQ((a.narrow(1, 0, 30) - b.narrow(1, 0, 30)).abs().max().item<double>(), 0.0);
  EXPECT_GT((a.narrow(1, 30, 7) - b.narrow(1, 30, 7)).abs().max().item<double>(), 0.0);
}

// The KDA mixer in sequence tiles (the state carried, the convolution reading the tokens before
// each tile) equals the untiled mixer: outputs, the input's gradient and every parameter's, with
// tiles that are and are not multiples of the chunk, a last tile of one token, segments of the
// chunked op shorter than a tile, and without grad.
// The model is fp64 but its gate and beta are fp32 by design, and the projections feeding them
// round differently when run over fewer rows: the bar is fp32's 1e-5 relative (a lost state or
// conv context is off by orders more).
TEST(HybridModelTest, KdaTilesEqualTheUntiledMixer) {
  ModelConfig c = TinyHybrid();
  KdaAttention m(c);
  m->InitSpecial(std::nullopt);
  m->to(torch::kFloat64);
  torch::manual_seed(21);
  for (auto& p : m->parameters()) {
    torch::NoGradGuard no_grad;
    if (p.dim() >= 2) p.copy_(torch::randn_like(p) * 0.2);
  }
  const int64_t S = 161;
  torch::Tensor x = torch::randn({2, S, c.hidden_size}, torch::kFloat64);
  torch::Tensor gy = torch::randn({2, S, c.hybrid.kda_num_heads * c.hybrid.kda_head_dim}, torch::kFloat64);
  auto run = [&](int64_t tile, int64_t segment) {
    m->set_tile(tile);
    m->set_segment(segment);
    m->zero_grad();
    torch::Tensor xi = x.clone().requires_grad_(true);
    torch::Tensor y = m->Heads(xi, AttentionMeta{});
    y.backward(gy);
    std::map<std::string, torch::Tensor> out = {{"y", y.detach()}, {"dx", xi.grad()}};
    for (auto& p : m->named_parameters()) {
      if (p.key().rfind("o_proj.", 0) == 0) continue;  // after Heads
      EXPECT_TRUE(p.value().grad().defined()) << p.key() << " tile " << tile;
      if (p.value().grad().defined()) out[p.key()] = p.value().grad().clone();
    }
    return out;
  };
  const int64_t C = c.hybrid.kda_chunk_size;
  auto plain = run(0, KdaAttentionImpl::kDefaultSegment);
  ASSERT_GT(plain["dx"].abs().max().item<double>(), 0.0);
  for (auto [tile, segment] : std::vector<std::pair<int64_t, int64_t>>{
           {37, KdaAttentionImpl::kDefaultSegment}, {64, KdaAttentionImpl::kDefaultSegment}, {160, C}, {0, C}}) {
    auto tiled = run(tile, segment);
    for (const auto& [name, want] : plain) {
      const double scale = 1.0 + want.abs().max().item<double>();
      EXPECT_LT((tiled[name] - want).abs().max().item<double>(), 1e-5 * scale)
          << name << " tile " << tile << " segment " << segment;
    }
    torch::NoGradGuard no_grad;
    EXPECT_LT((m->Heads(x, AttentionMeta{}) - plain["y"]).abs().max().item<double>(), 1e-5)
        << "no grad, tile " << tile << " segment " << segment;
  }
  m->set_tile(KdaAttentionImpl::kDefaultTile);
  m->set_segment(KdaAttentionImpl::kDefaultSegment);
  EXPECT_THROW(m->set_segment(C + 1), c10::Error);
  EXPECT_THROW(m->set_segment(0), c10::Error);
}

// A DSA layer of `c` in fp64 with weights drawn from `seed` (norm-like vectors around 1).
DsaAttention RandomFp64Dsa(const ModelConfig& c, uint64_t seed) {
  DsaAttention m(c);
  m->to(torch::kFloat64);
  torch::manual_seed(seed);
  torch::NoGradGuard no_grad;
  for (auto& p : m->parameters()) {
    p.copy_(torch::randn_like(p) * (p.dim() >= 2 ? 0.3 : 0.1) + (p.dim() == 1 ? 1.0 : 0.0));
  }
  return m;
}

// The DSA layer's sparse stage in query tiles equals plain autograd of the untiled layer (the
// projections, the selection, SparseAttention and IndexerKlLoss composed directly): the output,
// the KL, the input's gradient and every parameter's, with tiles that split a pool, a last tile
// of one token and one tile for the whole row, the KV heads in one group and in two (the
// backward's head groups); and without grad.
TEST(HybridModelTest, DsaTilesEqualPlainAutograd) {
  ModelConfig c = TinyHybrid();
  DsaAttention m = RandomFp64Dsa(c, 23);
  const int64_t B = 2, S = 161, H = c.num_attention_heads, Hkv = c.num_key_value_heads, D = c.HeadDim();
  const double kl_weight = 0.7;
  torch::Tensor x = torch::randn({B, S, c.hidden_size}, torch::kFloat64);
  torch::Tensor gy = torch::randn({B, S, H * D}, torch::kFloat64);
  using Grads = std::map<std::string, torch::Tensor>;
  auto collect = [&](const torch::Tensor& xi, const torch::Tensor& y, const torch::Tensor& kl) {
    Grads out = {{"y", y.detach()}, {"kl", kl.detach().to(torch::kFloat64).view({1})}, {"dx", xi.grad()}};
    for (auto& p : m->named_parameters()) {
      if (p.key().rfind("o_proj.", 0) == 0) continue;  // after Heads
      EXPECT_TRUE(p.value().grad().defined()) << p.key();
      if (p.value().grad().defined()) out[p.key()] = p.value().grad().clone();
    }
    return out;
  };
  // Plain autograd of the untiled layer.
  m->zero_grad();
  Grads plain;
  {
    torch::Tensor xi = x.clone().requires_grad_(true);
    torch::Tensor q = m->q_proj(xi).view({B, S, H, D}).transpose(1, 2);
    torch::Tensor k = m->k_proj(xi).view({B, S, Hkv, D}).transpose(1, 2);
    torch::Tensor v = m->v_proj(xi).view({B, S, Hkv, D}).transpose(1, 2);
    DsaIndexerImpl::Out ix = m->indexer(xi.detach());
    kernels::DsaIndexerOptions o;
    o.top_k = c.hybrid.index_top_k / 4;
    o.pool = 4;
    torch::Tensor pool = kernels::IndexerTopK(ix.q.detach(), ix.keys.detach(), ix.w.detach(), o);
    torch::Tensor idx = kernels::ExpandPoolSelection(pool);
    torch::Tensor y = kernels::SparseAttention(q, k, v, idx).transpose(1, 2).reshape({B, S, H * D});
    torch::Tensor target;
    {
      torch::NoGradGuard no_grad;
      const int64_t kp = pool.size(2);
      torch::Tensor p = kernels::SparseAttentionProbs(q, k, idx, 1.0 / std::sqrt(static_cast<double>(D)));
      target = p.narrow(2, 0, 4 * kp).reshape({B, S, kp, 4}).sum(-1).masked_fill(pool < 0, 0.0);
      target = target / target.sum(-1, true).clamp_min(1e-30);
    }
    const double rows = static_cast<double>((pool.select(2, 0) >= 0).sum().item<int64_t>());
    torch::Tensor kl = kernels::IndexerKlLoss(ix.q, ix.keys, ix.w, pool, target) / rows;
    ((y * gy).sum() + kl_weight * kl).backward();
    plain = collect(xi, y, kl);
  }
  ASSERT_GT(plain["dx"].abs().max().item<double>(), 0.0);
  ASSERT_GT(plain["indexer.wq.weight"].abs().max().item<double>(), 0.0);
  ASSERT_EQ(Hkv, 2);
  for (auto [tile, groups] : std::vector<std::pair<int64_t, int64_t>>{{1000, 1}, {37, 1}, {6, 1}, {160, 1}, {37, 2}, {1000, 2}}) {
    m->set_tile(tile);
    m->set_head_groups(groups);
    m->zero_grad();
    torch::Tensor xi = x.clone().requires_grad_(true);
    torch::Tensor kl;
    torch::Tensor y = m->Heads(xi, AttentionMeta{}, nullptr, &kl);
    ASSERT_TRUE(kl.defined()) << "tile " << tile;
    ((y * gy).sum() + kl_weight * kl).backward();
    Grads tiled = collect(xi, y, kl);
    for (const auto& [name, want] : plain) {
      // The KL leaves the layer in fp32 (what InjectAuxLoss takes), so it and the indexer's
      // gradients (scaled by it in backward) are equal to fp32's rounding; the rest to fp64's.
      const bool fp32 = name == "kl" || name.find("indexer.") == 0;
      const double bar = (fp32 ? 1e-6 : 1e-10) * (1.0 + want.abs().max().item<double>());
      ASSERT_TRUE(tiled.count(name)) << name;
      EXPECT_LT((tiled[name] - want).abs().max().item<double>(), bar) << name << " tile " << tile << " head groups "
                                                                        << groups;
    }
    torch::NoGradGuard no_grad;
    EXPECT_LT((m->Heads(x, AttentionMeta{}, nullptr, nullptr) - plain["y"]).abs().max().item<double>(), 1e-10)
        << "no grad, tile " << tile;
  }
  EXPECT_THROW(m->set_tile(0), c10::Error);
  EXPECT_THROW(m->set_head_groups(0), c10::Error);
  EXPECT_THROW(m->set_head_groups(3), c10::Error);  // not a divisor of the 2 KV heads
}

// The layer's input norm folded into the DSA layer's tiled Function (Heads' input_norm: the
// backward normalizes a tile of rows at a time, the pooled keys by chunks of whole pools, and
// keeps the norm's input, not its output) equals the norm run first under plain autograd: the
// output, the KL, the input's gradient, every parameter's and the norm weight's, with tiles that
// split a pool, one token long at the end, or the whole row, in one and two KV-head groups; and
// without grad.
TEST(HybridModelTest, DsaFoldedInputNormEqualsTheNormFirst) {
  ModelConfig c = TinyHybrid();
  DsaAttention m = RandomFp64Dsa(c, 29);
  RMSNorm norm(c.hidden_size, c.rms_norm_eps);
  norm->to(torch::kFloat64);
  {
    torch::NoGradGuard no_grad;
    norm->weight.copy_(1.0 + 0.3 * torch::randn({c.hidden_size}, torch::kFloat64));
  }
  const int64_t B = 2, S = 161, H = c.num_attention_heads, D = c.HeadDim();
  const torch::Tensor h = 2.0 * torch::randn({B, S, c.hidden_size}, torch::kFloat64);
  const torch::Tensor gy = torch::randn({B, S, H * D}, torch::kFloat64);
  using Grads = std::map<std::string, torch::Tensor>;
  auto run = [&](bool folded) {
    m->zero_grad();
    norm->zero_grad();
    torch::Tensor hi = h.clone().requires_grad_(true);
    torch::Tensor kl;
    torch::Tensor y = folded ? m->Heads(hi, AttentionMeta{}, nullptr, &kl, nullptr, norm.get())
                             : m->Heads(norm(hi), AttentionMeta{}, nullptr, &kl);
    EXPECT_TRUE(kl.defined());
    ((y * gy).sum() + 0.7 * kl).backward();
    Grads out = {{"y", y.detach()}, {"kl", kl.detach().to(torch::kFloat64).view({1})}, {"dh", hi.grad()},
                 {"norm.weight", norm->weight.grad().clone()}};
    for (auto& p : m->named_parameters()) {
      if (p.key().rfind("o_proj.", 0) == 0) continue;
      EXPECT_TRUE(p.value().grad().defined()) << p.key() << " folded " << folded;
      if (p.value().grad().defined()) out[p.key()] = p.value().grad().clone();
    }
    return out;
  };
  for (auto [tile, groups] : std::vector<std::pair<int64_t, int64_t>>{{1000, 1}, {37, 1}, {6, 2}, {160, 1}, {37, 2}}) {
    m->set_tile(tile);
    m->set_head_groups(groups);
    const Grads want = run(false), got = run(true);
    ASSERT_GT(want.at("norm.weight").abs().max().item<double>(), 0.0);
    ASSERT_GT(want.at("indexer.wk.weight").abs().max().item<double>(), 0.0);
    for (const auto& [name, w] : want) {
      // The KL and the indexer's gradients leave in fp32 (as in DsaTilesEqualPlainAutograd); the
      // norm's backward computes in fp32 (kernels::RmsNormRowsBackward), and folded it runs per
      // tile and per KV-head group, its input's and weight's gradients summed in another order.
      const bool fp32 = name == "kl" || name.find("indexer.") == 0;
      const bool through_norm = name == "dh" || name == "norm.weight";
      const double bar = (through_norm ? 1e-5 : fp32 ? 1e-6 : 1e-10) * (1.0 + w.abs().max().item<double>());
      ASSERT_TRUE(got.count(name)) << name;
      EXPECT_LT((got.at(name) - w).abs().max().item<double>(), bar) << name << " tile " << tile << " groups " << groups;
    }
    torch::NoGradGuard no_grad;
    EXPECT_LT((m->Heads(h, AttentionMeta{}, nullptr, nullptr, nullptr, norm.get()) - want.at("y")).abs().max().item<double>(),
              1e-10)
        << "no grad, tile " << tile;
  }
}

// Kept selections (DsaAttentionImpl::set_selection_mode): a kRecord pass keeps each call's pool
// selection; a kReplay pass uses them in order, whatever its input, and so equals the layer
// computed with the recorded input's selection (not its own); a replay without grad keeps them,
// one with grad releases them; a replay with nothing kept, or for another length, is refused.
TEST(HybridModelTest, DsaKeptSelectionsReplayInOrder) {
  ModelConfig c = TinyHybrid();
  DsaAttention m = RandomFp64Dsa(c, 29);
  m->set_tile(37);
  const int64_t B = 2, S = 161, H = c.num_attention_heads, Hkv = c.num_key_value_heads, D = c.HeadDim();
  const int64_t kp = c.hybrid.index_top_k / 4;
  using Mode = DsaAttentionImpl::SelectionMode;
  const torch::Tensor x1 = torch::randn({B, S, c.hidden_size}, torch::kFloat64);
  const torch::Tensor x2 = torch::randn({B, S, c.hidden_size}, torch::kFloat64);
  // The layer's heads for input x at the selection the indexer makes for input `chooser`.
  auto heads_at = [&](const torch::Tensor& x, const torch::Tensor& chooser) {
    torch::NoGradGuard no_grad;
    DsaIndexerImpl::Out ix = m->indexer(chooser);
    kernels::DsaIndexerOptions o;
    o.top_k = kp;
    o.pool = 4;
    torch::Tensor idx = kernels::ExpandPoolSelection(kernels::IndexerTopK(ix.q, ix.keys, ix.w, o));
    torch::Tensor q = m->q_proj(x).view({B, S, H, D}).transpose(1, 2);
    torch::Tensor k = m->k_proj(x).view({B, S, Hkv, D}).transpose(1, 2);
    torch::Tensor v = m->v_proj(x).view({B, S, Hkv, D}).transpose(1, 2);
    return kernels::SparseAttention(q, k, v, idx).transpose(1, 2).reshape({B, S, H * D});
  };
  const torch::Tensor want1 = heads_at(x2, x1), want2 = heads_at(x1, x2);
  ASSERT_GT((want1 - heads_at(x2, x2)).abs().max().item<double>(), 1e-3) << "the selections do not differ";
  {
    torch::NoGradGuard no_grad;
    DsaSelectionScope record(m.get(), Mode::kRecord);
    m->Heads(x1, AttentionMeta{}, nullptr, nullptr);
    m->Heads(x2, AttentionMeta{}, nullptr, nullptr);
  }
  EXPECT_EQ(m->kept_selection_bytes(), 2 * B * S * kp * 4);
  EXPECT_EQ(m->selection_mode(), Mode::kOff);
  {
    torch::NoGradGuard no_grad;
    DsaSelectionScope replay(m.get(), Mode::kReplay);
    EXPECT_LT((m->Heads(x2, AttentionMeta{}, nullptr, nullptr) - want1).abs().max().item<double>(), 1e-10);
    EXPECT_LT((m->Heads(x1, AttentionMeta{}, nullptr, nullptr) - want2).abs().max().item<double>(), 1e-10);
  }
  EXPECT_EQ(m->kept_selection_bytes(), 2 * B * S * kp * 4) << "a replay without grad released a selection";
  {
    DsaSelectionScope replay(m.get(), Mode::kReplay);
    torch::Tensor xi = x2.clone().requires_grad_(true), kl;
    torch::Tensor y = m->Heads(xi, AttentionMeta{}, nullptr, &kl);
    EXPECT_LT((y.detach() - want1).abs().max().item<double>(), 1e-10);
    EXPECT_EQ(m->kept_selection_bytes(), B * S * kp * 4) << "the replay with grad did not release its selection";
    y.sum().backward();  // the backward reads the Function's own copy
    EXPECT_GT(xi.grad().abs().max().item<double>(), 0.0);
    m->Heads(x1, AttentionMeta{}, nullptr, nullptr);
    EXPECT_EQ(m->kept_selection_bytes(), 0);
    EXPECT_THROW(m->Heads(x1, AttentionMeta{}, nullptr, nullptr), c10::Error);  // nothing left to replay
  }
  {
    torch::NoGradGuard no_grad;
    DsaSelectionScope record(m.get(), Mode::kRecord);
    m->Heads(x1, AttentionMeta{}, nullptr, nullptr);
  }
  {
    torch::NoGradGuard no_grad;
    DsaSelectionScope replay(m.get(), Mode::kReplay);
    try {
      m->Heads(x1.narrow(1, 0, 100), AttentionMeta{}, nullptr, nullptr);
      ADD_FAILURE() << "a replay for another length ran";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find("kept selection is for 2 x 161 tokens"), std::string::npos)
          << e.what_without_backtrace();
    }
  }
  m->ClearSelections();
  EXPECT_EQ(m->kept_selection_bytes(), 0);
}

// The indexer KL (spec 2.3) trains the indexer and nothing else: the other parameters' gradients
// are the LM loss's alone (equal with the KL's weight 0), and the indexer's are the weight times
// the KL's, in both stages.
TEST(HybridModelTest, IndexerLossReachesOnlyTheIndexer) {
  for (IndexerStage stage : {IndexerStage::kSparse, IndexerStage::kDenseWarmup}) {
    std::map<double, std::map<std::string, torch::Tensor>> grads;
    double reported = 0;
    for (double weight : {0.0, 0.5, 1.0}) {
      ModelConfig c = TinyHybrid(stage);
      c.hybrid.indexer_loss_weight = weight;
      CausalLM m(c);
      m->InitRandom(9, 0.1);
      torch::manual_seed(4);
      torch::Tensor ids = torch::randint(0, 61, {2, 40}, torch::kInt64);
      torch::Tensor labels = torch::randint(0, 61, {2, 40}, torch::kInt64);
      torch::Tensor logits = torch::matmul(HybridHidden(m, ids), m->HeadWeight().t());
      torch::nn::functional::cross_entropy(logits.view({-1, 61}), labels.view({-1})).backward();
      if (weight > 0) {
        ASSERT_TRUE(m->IndexerLoss().defined());
        reported = m->IndexerLoss().item<double>();
        EXPECT_GT(reported, 0.0);
      } else {
        EXPECT_FALSE(m->IndexerLoss().defined());
      }
      for (auto& p : m->named_parameters()) {
        grads[weight][p.key()] = p.value().grad().defined() ? p.value().grad().clone() : torch::zeros_like(p.value());
      }
    }
    for (const auto& [name, g0] : grads[0.0]) {
      const torch::Tensor& g1 = grads[1.0][name];
      const torch::Tensor& gh = grads[0.5][name];
      if (name.find(".indexer.") != std::string::npos) {
        EXPECT_EQ(g0.abs().max().item<double>(), 0.0) << name << ": the LM loss reached the indexer";
        EXPECT_GT(g1.abs().max().item<double>(), 0.0) << name;
        EXPECT_LT((2 * gh - g1).abs().max().item<double>(), 1e-5 * (1 + g1.abs().max().item<double>())) << name;
      } else {
        EXPECT_TRUE(torch::equal(g0, g1)) << name << ": the indexer loss reached a non-indexer parameter";
      }
    }
  }
}

TEST(HybridModelTest, SafetensorsRoundTripKeepsTheGatesInFp32) {
  const auto dir = std::filesystem::temp_directory_path() / "odyssey_hybrid_roundtrip";
  std::filesystem::remove_all(dir);
  CausalLM m(TinyHybrid());
  m->InitRandom(2, 0.1);
  SaveOptions save;
  save.dtype = torch::kBFloat16;
  ASSERT_TRUE(SaveHfCheckpoint(m, dir.string(), save).ok());
  absl::StatusOr<CausalLM> back = LoadPretrained(dir.string(), torch::kFloat32, torch::kCPU);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE((*back)->config().IsHybrid());
  EXPECT_EQ((*back)->config().hybrid.index_top_k, 8);
  auto want = m->named_parameters();
  for (auto& p : (*back)->named_parameters()) {
    torch::Tensor w = want[p.key()];
    if (IsFp32Parameter(p.key())) {
      EXPECT_TRUE(torch::equal(p.value(), w)) << p.key() << " must come back exactly (fp32 in the file)";
    } else {
      EXPECT_TRUE(torch::equal(p.value(), w.to(torch::kBFloat16).to(torch::kFloat32))) << p.key();
    }
  }
  std::filesystem::remove_all(dir);
}

// LoRA: adapters add scale * B A x to exactly the targeted projections (checked against the
// formula written out), start as a no-op (B = 0), carry PEFT's tensor names, freeze the base, and
// merge into weights that give the same logits; the adapter folder round-trips and a folder of
// another rank is refused by name.
TEST(ModelTest, LoraAdaptersFollowTheFormulaMergeAndRoundTrip) {
  torch::manual_seed(1);
  const ModelConfig c = SmallConfig(Architecture::kQwen2);  // biases on q/k/v
  CausalLM m(c);
  m->InitRandom(2, 0.1);
  torch::Tensor ids = torch::randint(0, c.vocab_size, {2, 9}, torch::kInt64);
  ForwardInputs in;
  in.input_ids = ids;
  torch::NoGradGuard no_grad;
  const torch::Tensor base = m->Logits(in);  // (B, S, V)
  LoraConfig lora;
  lora.rank = 3;
  lora.alpha = 5;
  lora.target_modules = {"down_proj", "q_proj", "o_proj", "up_proj"};
  ASSERT_TRUE(AttachLora(*m, lora, 7).ok());
  EXPECT_EQ(AttachLora(*m, lora, 7).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(torch::equal(m->Logits(in), base)) << "B starts at zero";
  std::set<std::string> adapters;
  for (auto& p : m->named_parameters()) {
    EXPECT_EQ(p.value().requires_grad(), IsLoraParameter(p.key())) << p.key();
    if (IsLoraParameter(p.key())) {
      adapters.insert(p.key());
      if (p.key().find(".lora_B.") != std::string::npos) p.value().normal_(0.0, 0.2);
    }
  }
  EXPECT_EQ(adapters.size(), 2u * 4u * 2u);
  EXPECT_TRUE(adapters.count("model.layers.1.self_attn.q_proj.lora_A.weight"));
  EXPECT_TRUE(adapters.count("model.layers.0.mlp.down_proj.lora_B.weight"));
  EXPECT_FALSE(adapters.count("model.layers.0.self_attn.k_proj.lora_A.weight"));
  EXPECT_EQ(lora.NumParameters(c), [&] {
    int64_t n = 0;
    for (auto& p : m->named_parameters())
      if (IsLoraParameter(p.key())) n += p.value().numel();
    return n;
  }());
  // The formula on one projection: q_proj(x) + 5/3 * x A^T B^T.
  AttentionImpl& a = *m->model->layer_list[0]->self_attn;
  torch::Tensor x = torch::randn({4, c.hidden_size});
  torch::Tensor want = torch::nn::functional::linear(x, a.q_proj->weight, a.q_proj->bias) +
                       torch::matmul(torch::matmul(x, a.q_lora.A->weight.t()), a.q_lora.B->weight.t()) * (5.0 / 3.0);
  EXPECT_LT((Project(a.q_proj, a.q_lora, x) - want).abs().max().item<double>(), 1e-6);
  const torch::Tensor adapted = m->Logits(in);
  EXPECT_GT((adapted - base).abs().max().item<double>(), 1e-3) << "the adapters change the output";
  // Merged weights in a plain model give the adapted logits.
  CausalLM plain(c);
  auto plain_params = plain->named_parameters();
  const auto merged = MergedParameters(*m);
  EXPECT_EQ(merged.size(), plain_params.size());
  for (const auto& [name, t] : merged) plain_params[name].copy_(t);
  EXPECT_LT((plain->Logits(in) - adapted).abs().max().item<double>(), 1e-5);
  // The adapter folder: PEFT's names, loaded into fresh adapters.
  const auto dir = std::filesystem::temp_directory_path() / "odyssey_model_test_lora";
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(SaveLoraAdapter(m, dir.string(), torch::kFloat32, "base").ok());
  auto file = SafetensorsFile::Open((dir / "adapter_model.safetensors").string());
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->tensors().size(), adapters.size());
  EXPECT_TRUE((*file)->tensors().count("base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"));
  CausalLM loaded(c);
  for (auto& p : loaded->named_parameters()) p.value().copy_(m->named_parameters()[p.key()]);
  ASSERT_TRUE(AttachLora(*loaded, lora, 99).ok());
  ASSERT_TRUE(LoadLoraAdapter(loaded, dir.string()).ok());
  EXPECT_TRUE(torch::equal(loaded->Logits(in), adapted));
  CausalLM other(c);
  LoraConfig rank2 = lora;
  rank2.rank = 2;
  ASSERT_TRUE(AttachLora(*other, rank2, 1).ok());
  absl::Status s = LoadLoraAdapter(other, dir.string());
  EXPECT_NE(s.message().find("adapters of rank 3"), std::string::npos) << s;
  std::filesystem::remove_all(dir);
}

// LoRA on the hybrid family: adapters on the KDA and DSA layers' q, k, v and o projections (KDA's
// H K wide, DSA's GQA shapes) and the MLPs; B = 0 leaves the output alone, nonzero B changes it
// exactly as merging the adapters into the weights does, the backward reaches the adapters only
// (every one of them), and the indexer stays frozen with the base (no KL without its gradient).
TEST(HybridModelTest, LoraAdaptersOnKdaAndDsaLayersActMergeAndTrainAlone) {
  torch::manual_seed(4);
  const ModelConfig c = NamedShape("hybrid-tiny").value();
  CausalLM m(c);
  m->InitRandom(3, 0.1);
  ForwardInputs in;
  in.input_ids = torch::randint(0, c.vocab_size, {2, 40}, torch::kInt64);  // past 16 + 3: truly sparse
  torch::Tensor base;
  {
    torch::NoGradGuard no_grad;
    base = m->Logits(in);
  }
  LoraConfig lora;
  lora.rank = 4;
  lora.alpha = 8;
  ASSERT_TRUE(AttachLora(*m, lora, 11).ok());
  int64_t adapter_params = 0;
  {
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(torch::equal(m->Logits(in), base)) << "B starts at zero";
    for (auto& p : m->named_parameters()) {
      EXPECT_EQ(p.value().requires_grad(), IsLoraParameter(p.key())) << p.key();
      if (!IsLoraParameter(p.key())) continue;
      adapter_params += p.value().numel();
      if (p.key().find(".lora_B.") != std::string::npos) p.value().normal_(0.0, 0.2);
    }
  }
  EXPECT_EQ(adapter_params, lora.NumParameters(c));
  auto params = m->named_parameters();
  EXPECT_TRUE(params.contains("model.layers.0.self_attn.q_proj.lora_A.weight"));  // KDA
  EXPECT_TRUE(params.contains("model.layers.3.self_attn.k_proj.lora_B.weight"));  // DSA
  EXPECT_EQ(params["model.layers.0.self_attn.k_proj.lora_B.weight"].size(0), 64);  // KDA: 4 heads x 16
  EXPECT_EQ(params["model.layers.3.self_attn.k_proj.lora_B.weight"].size(0), 32);  // DSA: 2 KV heads x 16
  torch::Tensor adapted = m->Logits(in);
  EXPECT_GT((adapted.detach() - base).abs().max().item<double>(), 1e-3) << "the adapters change the output";
  adapted.square().mean().backward();
  for (auto& p : m->named_parameters()) {
    if (!IsLoraParameter(p.key())) {
      EXPECT_FALSE(p.value().grad().defined()) << p.key();
      continue;
    }
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_GT(p.value().grad().abs().max().item<double>(), 0.0) << p.key();
  }
  EXPECT_FALSE(m->IndexerLoss().defined()) << "the frozen indexer computes no KL";
  // Merged weights in a plain hybrid model give the adapted logits.
  CausalLM plain(c);
  auto plain_params = plain->named_parameters();
  const auto merged = MergedParameters(*m);
  EXPECT_EQ(merged.size(), plain_params.size());
  torch::NoGradGuard no_grad;
  for (const auto& [name, t] : merged) plain_params[name].copy_(t);
  EXPECT_LT((plain->Logits(in) - adapted.detach()).abs().max().item<double>(), 1e-5);
}

}  // namespace
}  // namespace odyssey::model
