#include "server/validation.h"

#include <sys/stat.h>

#include <filesystem>
#include <cmath>
#include <fstream>
#include <functional>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/config.h"

namespace odyssey::server {
namespace {

namespace v1 = odyssey::v1;
using ::testing::HasSubstr;

v1::JobSpec GoodSpec() {
  v1::JobSpec spec;
  spec.mutable_model()->set_name("tiny");
  spec.mutable_optimizer()->set_lr(1e-3);
  spec.mutable_data()->set_format("kjv");
  spec.mutable_data()->set_seq_len(64);
  spec.mutable_data()->set_batch_size(2);
  spec.set_steps(10);
  return spec;
}

TEST(ValidationTest, GoodSpecPasses) { EXPECT_TRUE(ValidateJobSpec(GoodSpec()).ok()); }

TEST(ValidationTest, JobNamesAreCanonical) {
  EXPECT_EQ(*ParseJobName("jobs/31"), 31);
  EXPECT_EQ(*ParseJobName("jobs/999999999999999999"), 999999999999999999);
  for (const char* bad : {"jobs/ 1", "jobs/+1", "jobs/31 ", "jobs/01", "jobs/0", "jobs/-3", "jobs/1e3", "jobs/",
                          "job/1", " jobs/1", "jobs/1/", "jobs/9999999999999999999", "jobs/0x10"}) {
    absl::StatusOr<int64_t> id = ParseJobName(bad);
    EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(id.status().message(), HasSubstr("name: ")) << bad;
  }
}

TEST(ValidationTest, ErrorsQuoteABoundedValidPartOfTheInput) {
  const std::string huge = "jobs/" + std::string(10000, 'x') + "\xff";
  absl::StatusOr<int64_t> id = ParseJobName(huge);
  ASSERT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_LT(id.status().message().size(), 400u);
  EXPECT_THAT(id.status().message(), HasSubstr("(10006 bytes)"));
  v1::JobSpec spec = GoodSpec();
  spec.mutable_model()->set_name(std::string(5000, 'm') + "\xc3");
  const absl::Status s = ValidateJobSpec(spec);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("spec.model.name"));
  EXPECT_LT(s.message().size(), 1024u);
  EXPECT_EQ(ParseJobName("jobs/\x8b").status().message().find('\x8b'), std::string::npos);
}

TEST(ValidationTest, AFifoAsDataPathIsRefusedWithoutBlocking) {
  const std::string fifo = ::testing::TempDir() + "/odyssey-validation-fifo";
  std::filesystem::remove(fifo);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  v1::JobSpec spec = GoodSpec();
  spec.mutable_data()->set_format("text");
  spec.mutable_data()->set_path(fifo);
  const absl::Status s = ValidateJobSpec(spec);  // a blocking open would never return
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("spec.data.path: must be a readable regular file: "));
  EXPECT_THAT(s.message(), HasSubstr("is a FIFO"));
  std::filesystem::remove(fifo);
}

TEST(ValidationTest, OptimStepLearningRateIsBoundedNamingTheField) {
  v1::OptimStepRequest r;
  r.set_job("jobs/1");
  r.mutable_adam()->set_lr(1e300);
  const absl::Status s = ValidateOptimStepRequest(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("adam.lr: (1e+300) must be in (0, 10]"));
  r.mutable_adam()->set_lr(1e-4);
  EXPECT_TRUE(ValidateOptimStepRequest(r).ok());
}

// Each case breaks one rule; the status must carry the code and name the field.
TEST(ValidationTest, EachBrokenRuleNamesItsField) {
  struct Case {
    std::function<void(v1::JobSpec&)> mutate;
    absl::StatusCode code;
    std::string field;
  };
  const std::vector<Case> cases = {
      {[](v1::JobSpec& s) { s.mutable_model()->set_name("no-such-model"); }, absl::StatusCode::kInvalidArgument, "spec.model.name"},
      {[](v1::JobSpec& s) { s.mutable_model()->clear_name(); }, absl::StatusCode::kInvalidArgument, "spec.model.name"},
      {[](v1::JobSpec& s) { s.mutable_model()->set_dtype("fp8"); }, absl::StatusCode::kInvalidArgument, "spec.model.dtype"},
      {[](v1::JobSpec& s) { s.set_steps(0); }, absl::StatusCode::kInvalidArgument, "spec.steps"},
      {[](v1::JobSpec& s) { s.set_steps(-5); }, absl::StatusCode::kInvalidArgument, "spec.steps"},
      {[](v1::JobSpec& s) { s.mutable_optimizer()->set_lr(0); }, absl::StatusCode::kInvalidArgument, "spec.optimizer.lr"},
      {[](v1::JobSpec& s) { s.mutable_optimizer()->set_lr(-1); }, absl::StatusCode::kInvalidArgument, "spec.optimizer.lr"},
      {[](v1::JobSpec& s) { s.mutable_optimizer()->set_beta1(1.0); }, absl::StatusCode::kInvalidArgument, "spec.optimizer.beta1"},
      {[](v1::JobSpec& s) { s.mutable_data()->set_seq_len(1 << 30); }, absl::StatusCode::kInvalidArgument, "spec.data.seq_len"},
      {[](v1::JobSpec& s) { s.mutable_data()->set_seq_len(0); }, absl::StatusCode::kInvalidArgument, "spec.data.seq_len"},
      {[](v1::JobSpec& s) { s.mutable_data()->set_batch_size(0); }, absl::StatusCode::kInvalidArgument, "spec.data.batch_size"},
      // Sizes bounded before any product is formed (2^62 used to overflow the planner's arithmetic).
      {[](v1::JobSpec& s) { s.mutable_data()->set_batch_size(int64_t{1} << 62); }, absl::StatusCode::kInvalidArgument, "spec.data.batch_size"},
      {[](v1::JobSpec& s) { s.mutable_data()->set_batch_size(int64_t{1} << 25); }, absl::StatusCode::kInvalidArgument, "spec.data.batch_size"},
      {[](v1::JobSpec& s) {
         s.set_kind(v1::RL_SESSION);
         s.set_steps(0);
         s.mutable_data()->set_seq_len(64);
         s.mutable_data()->set_batch_size(int64_t{1} << 57);
       }, absl::StatusCode::kInvalidArgument, "spec.data.batch_size"},
      {[](v1::JobSpec& s) {
         s.mutable_model()->set_name("llama-3.2-1b");
         s.mutable_data()->set_seq_len(131072);
         s.mutable_data()->set_batch_size(int64_t{1} << 18);  // 2^35 positions
       }, absl::StatusCode::kInvalidArgument, "spec.data.batch_size"},
      {[](v1::JobSpec& s) { s.mutable_optimizer()->set_lr(1e300); }, absl::StatusCode::kInvalidArgument, "spec.optimizer.lr"},
      {[](v1::JobSpec& s) { s.mutable_data()->set_format("csv"); }, absl::StatusCode::kInvalidArgument, "spec.data.format"},
      {[](v1::JobSpec& s) {
         s.mutable_data()->set_format("text");
         s.mutable_data()->set_path("/nonexistent/odyssey/data.txt");
       }, absl::StatusCode::kInvalidArgument, "spec.data.path"},
      {[](v1::JobSpec& s) { s.mutable_data()->set_format("jsonl"); }, absl::StatusCode::kInvalidArgument, "spec.data.path"},
      {[](v1::JobSpec& s) { s.mutable_parallel()->set_world_size(-1); }, absl::StatusCode::kInvalidArgument, "spec.parallel.world_size"},
      {[](v1::JobSpec& s) {
         s.mutable_parallel()->set_world_size(4);
         s.mutable_parallel()->set_context_parallel(3);
       }, absl::StatusCode::kInvalidArgument, "spec.parallel.context_parallel"},
      {[](v1::JobSpec& s) { s.mutable_memory()->set_offload("maybe"); }, absl::StatusCode::kInvalidArgument, "spec.memory.offload"},
      {[](v1::JobSpec& s) { s.mutable_memory()->set_recompute("every_k"); }, absl::StatusCode::kInvalidArgument, "spec.memory.recompute_every_k"},
      {[](v1::JobSpec& s) { s.mutable_checkpoint()->set_every_steps(-1); }, absl::StatusCode::kInvalidArgument, "spec.checkpoint.every_steps"},
      {[](v1::JobSpec& s) { s.set_restart_limit(-1); }, absl::StatusCode::kInvalidArgument, "spec.restart_limit"},
      {[](v1::JobSpec& s) { s.set_display_name(std::string(1000, 'x')); }, absl::StatusCode::kInvalidArgument, "spec.display_name"},
      {[](v1::JobSpec& s) { s.set_kind(static_cast<v1::JobKind>(9)); }, absl::StatusCode::kInvalidArgument, "spec.kind"},
      {[](v1::JobSpec& s) {
         s.set_kind(v1::RL_SESSION);
         s.mutable_parallel()->set_world_size(6);
         s.mutable_parallel()->set_context_parallel(4);
       }, absl::StatusCode::kInvalidArgument, "spec.parallel.context_parallel"},
      {[](v1::JobSpec& s) {
         s.set_kind(v1::RL_SESSION);
         s.mutable_rl()->set_idle_timeout_seconds(-1);
       }, absl::StatusCode::kInvalidArgument, "spec.rl.idle_timeout_seconds"},
      {[](v1::JobSpec& s) { s.mutable_rl()->set_idle_timeout_seconds(5); }, absl::StatusCode::kInvalidArgument,
       "spec.rl.idle_timeout_seconds"},
      {[](v1::JobSpec& s) { s.mutable_profile()->set_trace_step(-1); }, absl::StatusCode::kInvalidArgument,
       "spec.profile.trace_step"},
      {[](v1::JobSpec& s) { s.mutable_profile()->set_trace_step(s.steps() + 1); }, absl::StatusCode::kInvalidArgument,
       "spec.profile.trace_step"},
      {[](v1::JobSpec& s) {
         s.set_kind(v1::RL_SESSION);
         s.mutable_profile()->set_trace_step(1);
       }, absl::StatusCode::kInvalidArgument, "spec.profile.trace_step"},
      {[](v1::JobSpec& s) { s.mutable_lora()->set_rank(65); }, absl::StatusCode::kInvalidArgument,
       "spec.lora.rank"},
      {[](v1::JobSpec& s) {
         s.mutable_lora()->set_rank(4);
         s.mutable_lora()->set_dropout(0.1);
       }, absl::StatusCode::kInvalidArgument, "spec.lora.dropout"},
      {[](v1::JobSpec& s) {
         s.mutable_lora()->set_rank(4);
         s.mutable_lora()->add_target_modules("lm_head");
       }, absl::StatusCode::kInvalidArgument, "spec.lora.target_modules[0]"},
      {[](v1::JobSpec& s) {  // hybrid-tiny's DSA layer has 2 KV heads
         s.mutable_model()->set_name("hybrid-tiny");
         s.mutable_parallel()->set_world_size(4);
         s.mutable_parallel()->set_context_parallel(4);
       }, absl::StatusCode::kInvalidArgument, "spec.parallel.context_parallel"},
      {[](v1::JobSpec& s) {  // whole pools of 4 per rank
         s.mutable_model()->set_name("hybrid-tiny");
         s.mutable_parallel()->set_world_size(2);
         s.mutable_parallel()->set_context_parallel(2);
         s.mutable_data()->set_seq_len(68);
       }, absl::StatusCode::kInvalidArgument, "spec.parallel.context_parallel"},
      {[](v1::JobSpec& s) {  // hybrid-tiny's narrowest adapted projection is 32 wide (DSA k/v)
         s.mutable_model()->set_name("hybrid-tiny");
         s.mutable_lora()->set_rank(33);
       }, absl::StatusCode::kInvalidArgument, "spec.lora.rank"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    v1::JobSpec spec = GoodSpec();
    cases[i].mutate(spec);
    absl::Status s = ValidateJobSpec(spec);
    EXPECT_EQ(s.code(), cases[i].code) << "case " << i << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(cases[i].field + ":")) << "case " << i;
  }
}

// The indexer's dense warm-up trains the DSA indexers alone: a plain job on a dense_warmup folder
// passes; LoRA and shard_params with it are refused naming their fields.
TEST(ValidationTest, DenseWarmupTrainsTheIndexersAlone) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "odyssey-validation-warmup";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  odyssey::model::ModelConfig c = *odyssey::model::NamedShape("hybrid-tiny");
  c.hybrid.indexer_stage = odyssey::model::IndexerStage::kDenseWarmup;
  std::ofstream(dir / "config.json") << odyssey::model::ToHfConfigJson(c, "float32");
  std::ofstream(dir / "model.safetensors") << "weights";
  v1::JobSpec spec = GoodSpec();
  spec.mutable_model()->set_name(dir.string());
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  v1::JobSpec lora = spec;
  lora.mutable_lora()->set_rank(4);
  EXPECT_THAT(std::string(ValidateJobSpec(lora).message()),
              HasSubstr("spec.lora.rank: (4) with the dense_warmup indexer stage"));
  v1::JobSpec shard = spec;
  shard.mutable_parallel()->set_world_size(2);
  shard.mutable_parallel()->set_shard_params(true);
  EXPECT_THAT(std::string(ValidateJobSpec(shard).message()),
              HasSubstr("spec.parallel.shard_params: (true) with the dense_warmup indexer stage"));
  // spec.model.indexer_stage replaces the folder's stage: sparse, the warm-up's rules are gone.
  v1::JobSpec sparse = shard;
  sparse.mutable_model()->set_indexer_stage("sparse");
  EXPECT_TRUE(ValidateJobSpec(sparse).ok()) << ValidateJobSpec(sparse);
  // ... and a named shape whose config says sparse warms up.
  v1::JobSpec warm = GoodSpec();
  warm.mutable_model()->set_name("hybrid-tiny");
  warm.mutable_model()->set_indexer_stage("dense_warmup");
  warm.mutable_lora()->set_rank(4);
  EXPECT_THAT(std::string(ValidateJobSpec(warm).message()),
              HasSubstr("spec.lora.rank: (4) with the dense_warmup indexer stage"));
  warm.mutable_model()->set_indexer_stage("warm");
  EXPECT_THAT(std::string(ValidateJobSpec(warm).message()),
              HasSubstr("spec.model.indexer_stage: 'warm' is not one of dense_warmup, sparse"));
  warm.mutable_model()->set_name("tiny");
  warm.mutable_model()->set_indexer_stage("sparse");
  EXPECT_THAT(std::string(ValidateJobSpec(warm).message()),
              HasSubstr("spec.model.indexer_stage (sparse) acts on DSA layers' indexers; the model has no DSA layers"));
  // Resuming across stages is refused: the warm-up's optimizer state covers the indexers alone.
  std::ofstream(dir / "trainer_state.json") << "{\"step\": 4}\n";
  std::ofstream(dir / "optimizer.safetensors") << "state";
  v1::JobSpec resume = GoodSpec();
  resume.mutable_model()->set_name("hybrid-tiny");
  resume.set_resume_from(dir.string());
  EXPECT_THAT(std::string(ValidateJobSpec(resume).message()),
              HasSubstr("spec.resume_from: the checkpoint trained the dense_warmup indexer stage and this job trains "
                        "sparse"));
  resume.mutable_model()->set_indexer_stage("dense_warmup");
  EXPECT_TRUE(ValidateJobSpec(resume).ok()) << ValidateJobSpec(resume);
  std::filesystem::remove_all(dir);
}

// LoRA is accepted for SFT jobs and RL sessions; with shard_params it is refused naming both.
TEST(ValidationTest, LoraSpec) {
  v1::JobSpec spec = GoodSpec();
  spec.mutable_lora()->set_rank(8);
  spec.mutable_lora()->set_alpha(16);
  spec.mutable_lora()->add_target_modules("q_proj");
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  spec.set_kind(v1::RL_SESSION);
  spec.clear_steps();
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  spec.mutable_parallel()->set_shard_params(true);
  EXPECT_THAT(std::string(ValidateJobSpec(spec).message()),
              HasSubstr("spec.lora.rank: (8) LoRA together with spec.parallel.shard_params is not implemented yet"));
}

// Context parallel over all of an SFT job's ranks, or data parallel over groups of them, is
// accepted (sharding only over all of them); the ranks must split the sequence.
TEST(ValidationTest, ContextParallelSpec) {
  v1::JobSpec spec = GoodSpec();
  spec.mutable_parallel()->set_world_size(2);
  spec.mutable_parallel()->set_context_parallel(2);
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  spec.mutable_parallel()->set_world_size(4);
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  spec.mutable_parallel()->set_shard_params(true);
  EXPECT_THAT(std::string(ValidateJobSpec(spec).message()),
              HasSubstr("spec.parallel.shard_params: with parallel.context_parallel (2) between 1 and "
                        "parallel.world_size (4) is not implemented"));
  spec.mutable_parallel()->set_shard_params(false);
  spec.mutable_parallel()->set_world_size(6);
  spec.mutable_parallel()->set_context_parallel(4);
  EXPECT_THAT(std::string(ValidateJobSpec(spec).message()),
              HasSubstr("context_parallel: (4) must divide parallel.world_size (6)"));
  spec.mutable_parallel()->set_world_size(4);
  spec.mutable_parallel()->set_context_parallel(4);
  spec.mutable_data()->set_seq_len(66);
  EXPECT_THAT(std::string(ValidateJobSpec(spec).message()),
              HasSubstr("context_parallel: (4) must divide spec.data.seq_len (66)"));
  // The hybrid family splits its KDA and DSA layers' heads: accepted where they divide.
  spec = GoodSpec();
  spec.mutable_model()->set_name("hybrid-tiny");
  spec.mutable_parallel()->set_world_size(2);
  spec.mutable_parallel()->set_context_parallel(2);
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  spec.mutable_data()->set_format("jsonl");
  spec.mutable_data()->set_path("/data/x.jsonl");
  EXPECT_THAT(std::string(ValidateJobSpec(spec).message()),
              HasSubstr("context_parallel: (2) with data.format \"jsonl\" (packed documents) is not implemented"));
}

// An RL session needs no steps and no dataset; its batch plan (seq_len x batch_size) is still required.
TEST(ValidationTest, RlSessionSpec) {
  v1::JobSpec spec = GoodSpec();
  spec.set_kind(v1::RL_SESSION);
  spec.clear_steps();
  spec.mutable_data()->set_format("jsonl");  // unused: no path needed
  spec.mutable_rl()->set_idle_timeout_seconds(60);
  spec.mutable_optimizer()->clear_lr();  // each OptimStep carries its lr
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  // Data parallel over several workers, one context-parallel group of them, or data parallel
  // over context-parallel groups.
  spec.mutable_parallel()->set_world_size(2);
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  spec.mutable_parallel()->set_context_parallel(2);
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  spec.mutable_parallel()->set_world_size(4);
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  spec.mutable_parallel()->set_world_size(3);
  EXPECT_THAT(std::string(ValidateJobSpec(spec).message()),
              HasSubstr("context_parallel: (2) must divide parallel.world_size (3)"));
  spec.mutable_parallel()->set_world_size(2);
  // Sharding is for SFT jobs.
  spec.mutable_parallel()->set_context_parallel(1);
  spec.mutable_parallel()->set_shard_params(true);
  EXPECT_THAT(std::string(ValidateJobSpec(spec).message()),
              HasSubstr("shard_params: is not implemented for RL_SESSION jobs yet"));
}

// Parameter sharding acts for SFT jobs: data parallel or context parallel ranks, or one rank.
TEST(ValidationTest, ShardParamsSpec) {
  v1::JobSpec spec = GoodSpec();
  spec.mutable_parallel()->set_shard_params(true);
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  spec.mutable_parallel()->set_world_size(2);
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  spec.mutable_parallel()->set_context_parallel(2);
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
}

// Plan reads model, data.seq_len, data.batch_size and memory only: a spec without lr or steps
// (or a dataset, or a resume folder) is planned; CreateJob still requires them; a value that is
// set is still checked.
TEST(ValidationTest, PlanRequiresOnlyWhatItReads) {
  v1::PlanRequest plan;
  v1::JobSpec* spec = plan.mutable_spec();
  spec->mutable_model()->set_name("tiny");
  spec->mutable_data()->set_seq_len(64);
  spec->mutable_data()->set_batch_size(2);
  spec->mutable_data()->set_format("jsonl");  // no path: a plan reads no data
  spec->set_resume_from("/no/such/checkpoint");
  EXPECT_TRUE(ValidatePlanRequest(plan).ok()) << ValidatePlanRequest(plan);
  v1::CreateJobRequest create;
  *create.mutable_spec() = *spec;
  EXPECT_THAT(std::string(ValidateCreateJobRequest(create).message()), HasSubstr("spec.optimizer.lr"));
  spec->mutable_optimizer()->set_lr(-1);
  EXPECT_THAT(std::string(ValidatePlanRequest(plan).message()), HasSubstr("spec.optimizer.lr: (-1)"));
  spec->mutable_optimizer()->clear_lr();
  spec->set_steps(-2);
  EXPECT_THAT(std::string(ValidatePlanRequest(plan).message()), HasSubstr("spec.steps: (-2) must be >= 0"));
  spec->clear_steps();
  spec->mutable_data()->set_seq_len(0);
  EXPECT_THAT(std::string(ValidatePlanRequest(plan).message()), HasSubstr("spec.data.seq_len"));
}

// spec.resume_from: a checkpoint folder an odyssey job wrote, of the model's shape, before the
// spec's steps; each broken rule is INVALID_ARGUMENT naming the field.
TEST(ValidationTest, ResumeFromMustBeACheckpointOfTheModelBeforeSteps) {
  const std::filesystem::path root = std::filesystem::path(::testing::TempDir()) / "odyssey-validation-resume";
  std::filesystem::remove_all(root);
  auto checkpoint = [&](const std::string& name, const std::string& shape, int64_t step, bool optimizer) {
    const std::filesystem::path dir = root / name;
    std::filesystem::create_directories(dir);
    std::ofstream(dir / "config.json") << odyssey::model::ToHfConfigJson(*odyssey::model::NamedShape(shape), "float32");
    std::ofstream(dir / "model.safetensors") << "weights";
    std::ofstream(dir / "trainer_state.json") << "{\"step\": " << step << ", \"model\": \"" << shape << "\"}\n";
    if (optimizer) std::ofstream(dir / "optimizer.safetensors") << "state";
    return dir.string();
  };
  v1::JobSpec spec = GoodSpec();  // tiny, 10 steps
  spec.set_resume_from(checkpoint("good", "tiny", 4, true));
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  struct Case {
    std::string resume_from;
    int64_t steps;
    std::string field, rule;
  };
  const std::vector<Case> cases = {
      {(root / "missing").string(), 10, "spec.resume_from", "is not a folder"},
      {"relative/step-00000004", 10, "spec.resume_from", "must be an absolute path"},
      {checkpoint("exported", "tiny", 4, false), 10, "spec.resume_from",
       "has no readable optimizer.safetensors"},
      {checkpoint("other-shape", "llama-3.2-1b", 4, true), 10, "spec.resume_from",
       "is not the shape of spec.model.name \"tiny\""},
      {checkpoint("done", "tiny", 10, true), 10, "spec.steps",
       "(10) must be greater than the step of spec.resume_from (10)"},
  };
  for (const Case& c : cases) {
    spec.set_resume_from(c.resume_from);
    spec.set_steps(c.steps);
    const absl::Status s = ValidateJobSpec(spec);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.resume_from;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.field + ": ")) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.rule)) << s;
  }
  // An exported folder is named as a base model instead: model.name.
  spec.set_resume_from((root / "exported").string());
  EXPECT_THAT(std::string(ValidateJobSpec(spec).message()), HasSubstr("name it in model.name instead"));
  // A LoRA job resumes from a LoRA checkpoint (adapter_config.json), a full one from weights.
  spec.set_resume_from((root / "good").string());
  spec.mutable_lora()->set_rank(4);
  EXPECT_THAT(std::string(ValidateJobSpec(spec).message()), HasSubstr("has no adapter_config.json"));
  std::ofstream(root / "good" / "adapter_config.json") << "{}";
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  spec.clear_lora();
  EXPECT_THAT(std::string(ValidateJobSpec(spec).message()), HasSubstr("is a LoRA checkpoint (adapter_config.json)"));
  std::filesystem::remove(root / "good" / "adapter_config.json");
  // RL sessions have no step target: a checkpoint at any step resumes.
  spec.set_kind(v1::RL_SESSION);
  spec.clear_steps();
  spec.set_resume_from((root / "done").string());
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  std::filesystem::remove_all(root);
}

v1::Datum OneDatum() {
  v1::Datum d;
  d.add_tokens(1);
  d.add_target_tokens(2);
  return d;
}

// Each TrainingService request breaks one edge rule: INVALID_ARGUMENT naming the field.
TEST(ValidationTest, TrainingRequestsNameTheField) {
  v1::ForwardBackwardRequest fb;
  fb.set_job("jobs/1");
  *fb.add_batch() = OneDatum();
  fb.mutable_loss()->set_kind("cross_entropy");
  EXPECT_TRUE(ValidateForwardBackwardRequest(fb).ok());
  struct Case {
    std::function<void(v1::ForwardBackwardRequest&)> mutate;
    std::string field;
  };
  const std::vector<Case> cases = {
      {[](auto& r) { r.set_job("job/1"); }, "job:"},
      {[](auto& r) { r.clear_batch(); }, "batch:"},
      {[](auto& r) { r.mutable_loss()->clear_kind(); }, "loss.kind:"},
      {[](auto& r) { r.mutable_loss()->set_kind("dpo"); }, "loss.kind:"},
      {[](auto& r) { r.mutable_loss()->set_clip_low(1.5); }, "loss.clip_low:"},
      {[](auto& r) { r.mutable_loss()->set_clip_high(-1); }, "loss.clip_high:"},
      {[](auto& r) { r.mutable_loss()->set_clip_high(1e300); }, "loss.clip_high:"},
      {[](auto& r) { r.set_sequence(-1); }, "sequence:"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    v1::ForwardBackwardRequest r = fb;
    cases[i].mutate(r);
    absl::Status s = ValidateForwardBackwardRequest(r);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "case " << i << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(cases[i].field)) << "case " << i;
  }

  v1::OptimStepRequest os;
  os.set_job("jobs/1");
  os.mutable_adam()->set_lr(1e-3);
  EXPECT_TRUE(ValidateOptimStepRequest(os).ok());
  for (auto mutate : std::vector<std::function<void(v1::AdamWParams&)>>{
           [](auto& a) { a.set_lr(0); }, [](auto& a) { a.set_lr(std::nan("")); },
           [](auto& a) { a.set_lr(INFINITY); }, [](auto& a) { a.set_beta1(1); },
           [](auto& a) { a.set_beta2(-0.1); }, [](auto& a) { a.set_eps(-1); },
           [](auto& a) { a.set_weight_decay(-0.1); }}) {
    v1::OptimStepRequest r = os;
    mutate(*r.mutable_adam());
    absl::Status s = ValidateOptimStepRequest(r);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("adam.")) << s;
  }

  v1::SaveCheckpointRequest save;
  save.set_job("jobs/1");
  EXPECT_TRUE(ValidateSaveCheckpointRequest(save).ok());  // empty = the job's checkpoint folder
  save.set_directory("relative/dir");
  EXPECT_THAT(std::string(ValidateSaveCheckpointRequest(save).message()), HasSubstr("directory:"));
  save.set_directory("/tmp/" + std::string(201, 'a') + "/x");  // the temp folder's name would pass 255 bytes
  EXPECT_THAT(std::string(ValidateSaveCheckpointRequest(save).message()),
              HasSubstr("directory: a path component of 201 bytes must be <= 200 bytes"));
  save.set_directory("/tmp/" + std::string(200, 'a'));
  EXPECT_TRUE(ValidateSaveCheckpointRequest(save).ok());
  v1::LoadCheckpointRequest load;
  load.set_job("jobs/1");
  EXPECT_THAT(std::string(ValidateLoadCheckpointRequest(load).message()), HasSubstr("directory: is required"));
  v1::ExportWeightsRequest ex;
  ex.set_job("jobs/1");
  ex.set_directory("/tmp/x");
  ex.set_dtype("int8");
  EXPECT_THAT(std::string(ValidateExportWeightsRequest(ex).message()), HasSubstr("dtype:"));
  ex.set_dtype("float32");
  EXPECT_TRUE(ValidateExportWeightsRequest(ex).ok());
}

TEST(ValidationTest, ReadableDatasetPasses) {
  const auto path = std::filesystem::temp_directory_path() / "odyssey_validation_test.txt";
  std::ofstream(path) << "hello";
  v1::JobSpec spec = GoodSpec();
  spec.mutable_data()->set_format("text");
  spec.mutable_data()->set_path(path.string());
  EXPECT_TRUE(ValidateJobSpec(spec).ok());
  std::filesystem::remove(path);
}

TEST(ValidationTest, JobNames) {
  EXPECT_EQ(JobName(7), "jobs/7");
  EXPECT_EQ(*ParseJobName("jobs/7"), 7);
  for (const char* bad : {"", "jobs/", "jobs/x", "jobs/-1", "job/1", "7"}) {
    auto id = ParseJobName(bad);
    EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(id.status().message()), HasSubstr("name:"));
  }
}

TEST(ValidationTest, ListRequest) {
  v1::ListJobsRequest r;
  EXPECT_TRUE(ValidateListJobsRequest(r).ok());
  r.set_page_size(5000);
  EXPECT_THAT(std::string(ValidateListJobsRequest(r).message()), HasSubstr("page_size:"));
  r.set_page_size(10);
  r.set_page_token("garbage");
  EXPECT_THAT(std::string(ValidateListJobsRequest(r).message()), HasSubstr("page_token:"));
}

TEST(ValidationTest, ListJobEventsRequest) {
  v1::ListJobEventsRequest r;
  EXPECT_TRUE(ValidateListJobEventsRequest(r).ok());
  r.set_page_size(kMaxEventPageSize + 1);
  EXPECT_THAT(std::string(ValidateListJobEventsRequest(r).message()), HasSubstr("page_size:"));
  r.set_page_size(10);
  r.set_page_token("-3");
  EXPECT_THAT(std::string(ValidateListJobEventsRequest(r).message()), HasSubstr("page_token:"));
}

}  // namespace
}  // namespace odyssey::server
