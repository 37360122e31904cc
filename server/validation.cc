#include "server/validation.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <filesystem>
#include <initializer_list>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/files.h"
#include "common/wire_text.h"
#include "model/config.h"
#include "nlohmann/json.hpp"
#include "planner/memory_spec.h"

namespace odyssey::server {
namespace {

namespace v1 = odyssey::v1;

std::string Quote(absl::string_view text);

absl::Status Invalid(absl::string_view field, absl::string_view rule) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", rule));
}

// Checks `value` is one of `allowed` (the empty string always is: it means the default).
absl::Status OneOf(absl::string_view field, const std::string& value,
                   std::initializer_list<absl::string_view> allowed) {
  if (value.empty()) return absl::OkStatus();
  for (absl::string_view a : allowed) {
    if (value == a) return absl::OkStatus();
  }
  return Invalid(field, absl::StrCat(Quote(value), " must be one of: ", absl::StrJoin(allowed, ", "),
                                     " (or empty for the default)"));
}

#define ODYSSEY_RETURN_IF_ERROR(expr)      \
  do {                                     \
    absl::Status _status = (expr);         \
    if (!_status.ok()) return _status;     \
  } while (0)

absl::Status CheckDirectory(const std::string& dir, absl::string_view field, bool required);

// The fields that make two configs the same parameter shapes (what a checkpoint's tensors and
// optimizer state must match), for an error message.
std::string Shape(const odyssey::model::ModelConfig& c) {
  return absl::StrCat(c.num_hidden_layers, " layers, hidden_size ", c.hidden_size, ", intermediate_size ",
                      c.intermediate_size, ", ", c.num_attention_heads, "/", c.num_key_value_heads,
                      " heads, head_dim ", c.HeadDim(), ", vocab_size ", c.vocab_size,
                      c.tie_word_embeddings ? ", tied embeddings" : "");
}

// spec.resume_from: a checkpoint folder an odyssey job wrote (weights, optimizer state and
// trainer_state.json), of the model's shape and, for SFT, before `steps`.
absl::Status CheckResumeFrom(const v1::JobSpec& spec, const odyssey::model::ModelConfig& model, const std::string& p,
                             bool rl, const odyssey::model::LoraConfig& lora) {
  const std::string field = p + ".resume_from";
  const std::string& dir = spec.resume_from();
  ODYSSEY_RETURN_IF_ERROR(CheckDirectory(dir, field, /*required=*/true));
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    return Invalid(field, absl::StrCat(Quote(dir), " is not a folder: name a checkpoint an odyssey job wrote "
                                       "(<checkpoint.directory>/step-NNNNNNNN, or a SaveCheckpoint folder)"));
  }
  for (const char* file : {"optimizer.safetensors", "trainer_state.json"}) {
    const std::string path = (std::filesystem::path(dir) / file).string();
    if (absl::Status s = CheckRegularFile(path); !s.ok()) {
      return Invalid(field, absl::StrCat(Quote(dir), " has no readable ", file, " (", s.message(),
                                         "): it is not a checkpoint an odyssey job wrote (an exported folder holds "
                                         "weights only: to start from its weights with a fresh optimizer, name it "
                                         "in model.name instead)"));
    }
  }
  // A LoRA job resumes from its adapters, a full one from weights: the checkpoint must be of its kind.
  const bool has_adapters = std::filesystem::exists(std::filesystem::path(dir) / "adapter_config.json", ec);
  if (lora.enabled() != has_adapters) {
    return Invalid(field, lora.enabled()
                              ? absl::StrCat(Quote(dir), " has no adapter_config.json: a job with ", p,
                                             ".lora resumes from a checkpoint of a LoRA job")
                              : absl::StrCat(Quote(dir), " is a LoRA checkpoint (adapter_config.json): set ", p,
                                             ".lora as it was trained to resume from it"));
  }
  absl::StatusOr<odyssey::model::ModelConfig> saved = odyssey::model::ResolveModelConfig(dir);
  if (!saved.ok()) {
    return Invalid(field, absl::StrCat("the checkpoint's config cannot be used: ", saved.status().message()));
  }
  const bool same = saved->architecture == model.architecture && saved->vocab_size == model.vocab_size &&
                    saved->hidden_size == model.hidden_size && saved->intermediate_size == model.intermediate_size &&
                    saved->num_hidden_layers == model.num_hidden_layers &&
                    saved->num_attention_heads == model.num_attention_heads &&
                    saved->num_key_value_heads == model.num_key_value_heads && saved->HeadDim() == model.HeadDim() &&
                    saved->tie_word_embeddings == model.tie_word_embeddings &&
                    saved->QkvBias() == model.QkvBias() && saved->OBias() == model.OBias() &&
                    saved->mlp_bias == model.mlp_bias && saved->QkNorm() == model.QkNorm();
  if (!same) {
    return Invalid(field, absl::StrCat("the checkpoint's model (", Shape(*saved), ") is not the shape of ", p,
                                       ".model.name ", Quote(spec.model().name()), " (", Shape(model),
                                       "): resume with the model.name the checkpoint was trained from"));
  }
  // Its optimizer state is the stage's: the warm-up's covers the indexers alone.
  if (model.IsHybrid() && model.NumLayersOfKind('D') > 0 &&
      saved->hybrid.indexer_stage != model.hybrid.indexer_stage) {
    return Invalid(field, absl::StrCat("the checkpoint trained the ", odyssey::model::IndexerStageName(saved->hybrid.indexer_stage),
                                       " indexer stage and this job trains ",
                                       odyssey::model::IndexerStageName(model.hybrid.indexer_stage), " (", p,
                                       ".model.indexer_stage or the model's config.json): the optimizer state is "
                                       "the stage's own; start the new stage from the checkpoint's weights (name "
                                       "the folder in model.name) with a fresh optimizer"));
  }
  const std::string state_path = (std::filesystem::path(dir) / "trainer_state.json").string();
  absl::StatusOr<std::string> text = ReadRegularFile(state_path, size_t{1} << 20);
  if (!text.ok()) return Invalid(field, absl::StrCat("trainer_state.json: ", text.status().message()));
  const nlohmann::json state = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (!state.is_object() || !state.contains("step") || !state["step"].is_number_integer() ||
      state["step"].get<int64_t>() < 0) {
    return Invalid(field, absl::StrCat(Quote(dir), ": trainer_state.json has no step (a non-negative integer)"));
  }
  const int64_t step = state["step"].get<int64_t>();
  if (!rl && spec.steps() > 0 && step >= spec.steps()) {
    return Invalid(p + ".steps", absl::StrCat("(", spec.steps(), ") must be greater than the step of ", field,
                                              " (", step, "): nothing would be left to train"));
  }
  return absl::OkStatus();
}

}  // namespace

std::string JobName(int64_t id) { return absl::StrCat("jobs/", id); }

namespace {
// `text` quoted for an error message: valid UTF-8, at most kMaxQuotedBytes of it.
std::string Quote(absl::string_view text) {
  if (text.size() <= kMaxQuotedBytes) return absl::StrCat("\"", ValidUtf8(text), "\"");
  // A character cut in two at the bound shows as \xNN escapes (still valid UTF-8).
  std::string valid = ValidUtf8(text.substr(0, kMaxQuotedBytes));
  return absl::StrCat("\"", valid, "\"... (", text.size(), " bytes)");
}
}  // namespace

absl::StatusOr<int64_t> ParseJobName(absl::string_view name, absl::string_view field) {
  if (name.empty()) return Invalid(field, "is required (\"jobs/{id}\")");
  constexpr absl::string_view kPrefix = "jobs/";
  // Canonical names only: "jobs/" then the decimal id as JobName writes it (no sign, spaces or
  // leading zeros), so one job has exactly one name.
  const absl::string_view digits = absl::StartsWith(name, kPrefix) ? name.substr(kPrefix.size()) : "";
  const bool canonical = !digits.empty() && digits.size() <= 18 && digits[0] != '0' &&
                         std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; });
  int64_t id = 0;
  if (!canonical || !absl::SimpleAtoi(digits, &id) || id <= 0) {
    return Invalid(field, absl::StrCat(Quote(name), " must be \"jobs/{id}\" with a positive decimal id (no sign, "
                                       "spaces or leading zeros)"));
  }
  return id;
}

absl::Status ValidateJobSpec(const v1::JobSpec& spec, absl::string_view f, SpecUse use) {
  const std::string p(f);
  const bool rl = spec.kind() == v1::RL_SESSION;
  const bool plan = use == SpecUse::kPlan;
  if (spec.kind() != v1::SFT && spec.kind() != v1::JOB_KIND_UNSPECIFIED && !rl) {
    return Invalid(p + ".kind", absl::StrCat("unknown kind ", static_cast<int>(spec.kind())));
  }
  if (spec.display_name().size() > kMaxDisplayNameBytes) {
    return Invalid(p + ".display_name", absl::StrCat("length (", spec.display_name().size(),
                                                     ") must be <= ", kMaxDisplayNameBytes, " bytes"));
  }

  // Model.
  const auto& model = spec.model();
  if (model.name().empty()) {
    return Invalid(p + ".model.name", "is required (a named shape such as \"tiny\" or a Hugging Face checkpoint directory)");
  }
  if (model.name().size() > kMaxPathBytes) {
    return Invalid(p + ".model.name", absl::StrCat("length (", model.name().size(), ") must be <= ", kMaxPathBytes,
                                                   " bytes (a named shape or a checkpoint directory)"));
  }
  auto config = odyssey::model::ResolveModelConfig(model.name());
  std::error_code dir_ec;
  if (!config.ok() && std::filesystem::is_directory(model.name(), dir_ec)) {
    // A checkpoint folder whose config cannot be loaded: its own reason first.
    return Invalid(p + ".model.name", absl::StrCat("the checkpoint directory's config cannot be used: ",
                                                   config.status().message()));
  }
  if (!config.ok()) {
    return Invalid(p + ".model.name",
                   absl::StrCat("unknown model ", Quote(model.name()), ": must be a named shape (",
                                absl::StrJoin(odyssey::model::NamedShapeNames(), ", "),
                                ") or a checkpoint directory with a readable config.json (",
                                config.status().message(), ")"));
  }
  ODYSSEY_RETURN_IF_ERROR(
      odyssey::model::SetIndexerStage(p + ".model.indexer_stage", model.indexer_stage(), &*config));
  ODYSSEY_RETURN_IF_ERROR(OneOf(p + ".model.dtype", model.dtype(), {"auto", "float32", "bfloat16"}));
  ODYSSEY_RETURN_IF_ERROR(OneOf(p + ".model.attention", model.attention(), {"auto", "math", "sdpa"}));

  // Parallelism.
  const auto& par = spec.parallel();
  if (par.world_size() < 0 || par.world_size() > kMaxWorldSize) {
    return Invalid(p + ".parallel.world_size",
                   absl::StrCat("(", par.world_size(), ") must be in [0, ", kMaxWorldSize, "] (0 = 1)"));
  }
  const int32_t world = std::max(1, par.world_size());
  if (par.context_parallel() < 0) {
    return Invalid(p + ".parallel.context_parallel",
                   absl::StrCat("(", par.context_parallel(), ") must be >= 0 (0 = 1)"));
  }
  const int32_t cp = std::max(1, par.context_parallel());
  if (world % cp != 0) {
    return Invalid(p + ".parallel.context_parallel",
                   absl::StrCat("(", cp, ") must divide parallel.world_size (", world, ")"));
  }
  if (cp > 1 && config->num_attention_heads % cp != 0) {
    return Invalid(p + ".parallel.context_parallel",
                   absl::StrCat("(", cp, ") must divide the model's num_attention_heads (",
                                config->num_attention_heads, ")"));
  }
  // Ulysses over all of the job's ranks (engine/parallel/ulysses.h): every rank holds
  // seq_len / cp positions of each row.
  if (cp > 1 && spec.data().seq_len() % cp != 0) {
    return Invalid(p + ".parallel.context_parallel",
                   absl::StrCat("(", cp, ") must divide spec.data.seq_len (", spec.data().seq_len(), ")"));
  }
  // Accepted means acted on: until the engine has them, these are refused, not ignored. Jobs
  // and sessions run data parallel over context-parallel groups of cp consecutive ranks.
  if (par.shard_params() && cp > 1 && cp != world) {
    return Invalid(p + ".parallel.shard_params",
                   absl::StrCat("with parallel.context_parallel (", cp, ") between 1 and parallel.world_size (", world,
                                ") is not implemented: sharding runs over one group of all ranks (set false, or "
                                "context_parallel 1 or ", world, ")"));
  }
  // LoRA: the converter the worker uses too; the rank against the model's dims here.
  absl::StatusOr<odyssey::model::LoraConfig> lora = odyssey::planner::LoraFromProto(spec.lora(), p + ".lora");
  if (!lora.ok()) return lora.status();
  ODYSSEY_RETURN_IF_ERROR(lora->Validate(p + ".lora", &*config));
  if (lora->enabled() && par.shard_params()) {
    return Invalid(p + ".lora.rank", absl::StrCat("(", lora->rank, ") LoRA together with ", p,
                                                  ".parallel.shard_params is not implemented yet: set one of them"));
  }
  // The indexer's dense warm-up trains the DSA indexers alone (spec 2.3; engine/trainer.cc).
  if (config->InDenseWarmup()) {
    const std::string stage = absl::StrCat(" with the dense_warmup indexer stage (model ", Quote(model.name()),
                                           "), where only the DSA indexers train");
    if (lora->enabled())
      return Invalid(p + ".lora.rank", absl::StrCat("(", lora->rank, ")", stage,
                                                    ": the indexers have no adapters; warm up without LoRA"));
    if (par.shard_params())
      return Invalid(p + ".parallel.shard_params",
                     absl::StrCat("(true)", stage, ", is not implemented (the indexers are small: train them unsharded)"));
  }
  // ZeRO-3 over all of the job's ranks (engine/parallel/sharding.h): SFT steps only; an RL
  // session's ranks run different datums (and an empty slice runs nothing), which the per-layer
  // all-gathers cannot follow.
  if (par.shard_params() && rl) {
    return Invalid(p + ".parallel.shard_params",
                   "is not implemented for RL_SESSION jobs yet: their ranks hold the whole model (set false)");
  }

  // Memory: the converter the worker uses too (planner/memory_spec.h), so both read a spec alike.
  if (absl::StatusOr<odyssey::planner::MemoryFields> memory =
          odyssey::planner::MemoryFieldsFromProto(spec.memory(), p + ".memory");
      !memory.ok()) {
    return memory.status();
  } else if (config->IsHybrid()) {
    // The hybrid family's KDA and DSA layers do not run through the dense attention backend,
    // so what acts only there is refused rather than ignored.
    const std::string why = absl::StrCat(" is not implemented for the hybrid family (model ", Quote(model.name()),
                                         "): its KDA and DSA layers do not run through the dense attention backend");
    if (cp > 1) {
      // Context parallelism runs inside the KDA and DSA layers (model/hybrid.h) where they can
      // split: their heads over the ranks, each rank's positions whole pools of 4.
      const std::string field = p + ".parallel.context_parallel";
      const std::string at = absl::StrCat("(", cp, ")");
      const auto& hy = config->hybrid;
      if (config->NumLayersOfKind('K') > 0 && hy.kda_num_heads % cp != 0)
        return Invalid(field, absl::StrCat(at, " must divide the KDA layers' heads (", hy.kda_num_heads, ")"));
      if (config->NumLayersOfKind('D') > 0) {
        if (config->num_key_value_heads % cp != 0)
          return Invalid(field, absl::StrCat(at, " must divide the DSA layers' KV heads (", config->num_key_value_heads,
                                             ")"));
        if (spec.data().seq_len() % (4 * cp) != 0)
          return Invalid(field, absl::StrCat(at, " x 4 must divide spec.data.seq_len (", spec.data().seq_len(),
                                             ") for the DSA layers: each rank's positions are whole pools of 4"));
        if (hy.indexer_stage != odyssey::model::IndexerStage::kSparse)
          return Invalid(field, absl::StrCat(at, " with the dense_warmup indexer stage", why));
      }
      if (spec.data().format() == "jsonl")
        return Invalid(field, absl::StrCat(at, " with data.format \"jsonl\" (packed documents) is not implemented "
                                               "for the hybrid family yet"));
    }
    if (memory->head_groups) {
      if (const std::string no = config->HeadGroupsRefusal(*memory->head_groups, cp); !no.empty())
        return Invalid(p + ".memory.attention_head_groups", absl::StrCat("(", *memory->head_groups, ")", no));
    }
    if (memory->keep_attention && *memory->keep_attention) return Invalid(p + ".memory.keep_attention", why.substr(1));
  }

  // Optimizer.
  const auto& opt = spec.optimizer();
  // An RL session's lr comes with each OptimStep, and a plan reads none: 0 (unset) is fine there.
  if ((!(rl || plan) || opt.lr() != 0) && !(opt.lr() > 0 && opt.lr() <= kMaxLearningRate)) {
    return Invalid(p + ".optimizer.lr", absl::StrCat("(", opt.lr(), ") must be in (0, ", kMaxLearningRate, "]",
                                                     rl ? " (or 0: RL sessions take lr from each OptimStep)" : ""));
  }
  if (!(opt.beta1() >= 0 && opt.beta1() < 1)) {
    return Invalid(p + ".optimizer.beta1", absl::StrCat("(", opt.beta1(), ") must be in [0, 1)"));
  }
  if (!(opt.beta2() >= 0 && opt.beta2() < 1)) {
    return Invalid(p + ".optimizer.beta2", absl::StrCat("(", opt.beta2(), ") must be in [0, 1)"));
  }
  if (!(opt.eps() >= 0) || !std::isfinite(opt.eps())) {
    return Invalid(p + ".optimizer.eps", absl::StrCat("(", opt.eps(), ") must be >= 0 and finite"));
  }
  if (!(opt.weight_decay() >= 0) || !std::isfinite(opt.weight_decay())) {
    return Invalid(p + ".optimizer.weight_decay", absl::StrCat("(", opt.weight_decay(), ") must be >= 0 and finite"));
  }
  if (opt.warmup_steps() < 0) {
    return Invalid(p + ".optimizer.warmup_steps", absl::StrCat("(", opt.warmup_steps(), ") must be >= 0"));
  }
  if (!(opt.min_lr_ratio() >= 0 && opt.min_lr_ratio() <= 1)) {
    return Invalid(p + ".optimizer.min_lr_ratio", absl::StrCat("(", opt.min_lr_ratio(), ") must be in [0, 1]"));
  }
  if (std::isnan(opt.grad_clip())) {
    return Invalid(p + ".optimizer.grad_clip", "must not be NaN (<= 0 disables clipping)");
  }

  // Data. An RL session reads no dataset (its batches come with the calls): format and path
  // are unused; seq_len x batch_size is the largest batch one call may carry.
  const auto& data = spec.data();
  if (!rl) ODYSSEY_RETURN_IF_ERROR(OneOf(p + ".data.format", data.format(), {"kjv", "text", "bin", "jsonl"}));
  if (!rl && !plan && !data.format().empty() && data.format() != "kjv") {
    if (data.path().empty()) {
      return Invalid(p + ".data.path", absl::StrCat("is required for data.format \"", data.format(), "\""));
    }
    // Opened without blocking (a FIFO there would hold this thread until someone wrote to it).
    if (absl::Status s = CheckRegularFile(data.path()); !s.ok()) {
      return Invalid(p + ".data.path", absl::StrCat("must be a readable regular file: ", s.message()));
    }
  }
  if (data.seq_len() <= 0) {
    return Invalid(p + ".data.seq_len", absl::StrCat("(", data.seq_len(), ") must be > 0"));
  }
  if (data.seq_len() > config->max_position_embeddings) {
    return Invalid(p + ".data.seq_len",
                   absl::StrCat("(", data.seq_len(), ") must be <= the model's max_position_embeddings (",
                                config->max_position_embeddings, ")"));
  }
  if (data.batch_size() <= 0 || data.batch_size() > kMaxBatchSize) {
    return Invalid(p + ".data.batch_size",
                   absl::StrCat("(", data.batch_size(), ") must be in [1, ", kMaxBatchSize, "]"));
  }
  // Both are bounded now (seq_len by max_position_embeddings, an int32 in every config), so
  // the product cannot overflow.
  if (data.seq_len() > kMaxTokensPerStep / data.batch_size()) {
    return Invalid(p + ".data.batch_size",
                   absl::StrCat("data.seq_len x data.batch_size (", data.seq_len(), " x ", data.batch_size(),
                                ") must be <= ", kMaxTokensPerStep, " token positions per rank"));
  }

  // Run.
  if (!rl && !plan && spec.steps() <= 0) {
    return Invalid(p + ".steps", absl::StrCat("(", spec.steps(), ") must be > 0"));
  }
  if ((rl || plan) && spec.steps() < 0) {
    return Invalid(p + ".steps", absl::StrCat("(", spec.steps(), ") must be >= 0 (unused by ",
                                              rl ? "RL_SESSION jobs" : "a plan", ")"));
  }
  if (spec.rl().idle_timeout_seconds() < 0) {
    return Invalid(p + ".rl.idle_timeout_seconds",
                   absl::StrCat("(", spec.rl().idle_timeout_seconds(), ") must be >= 0 (0 = ",
                                kDefaultIdleTimeoutSeconds, ")"));
  }
  if (!rl && spec.rl().idle_timeout_seconds() != 0) {
    return Invalid(p + ".rl.idle_timeout_seconds", "is only for RL_SESSION jobs (spec.kind)");
  }
  const int64_t trace_step = spec.profile().trace_step();
  if (trace_step < 0) {
    return Invalid(p + ".profile.trace_step", absl::StrCat("(", trace_step, ") must be >= 0 (0 = no trace)"));
  }
  if (rl && trace_step != 0) {
    return Invalid(p + ".profile.trace_step",
                   "is not implemented for RL_SESSION jobs yet: traces are of SFT jobs' steps (set 0)");
  }
  if (!rl && !plan && trace_step > spec.steps()) {
    return Invalid(p + ".profile.trace_step",
                   absl::StrCat("(", trace_step, ") must be <= spec.steps (", spec.steps(), "): a step the job runs"));
  }
  const auto& ckpt = spec.checkpoint();
  if (ckpt.every_steps() < 0) {
    return Invalid(p + ".checkpoint.every_steps", absl::StrCat("(", ckpt.every_steps(), ") must be >= 0 (0 = only at the end)"));
  }
  if (ckpt.keep() < 0) {
    return Invalid(p + ".checkpoint.keep", absl::StrCat("(", ckpt.keep(), ") must be >= 0 (0 = all)"));
  }
  if (spec.restart_limit() < 0) {
    return Invalid(p + ".restart_limit", absl::StrCat("(", spec.restart_limit(), ") must be >= 0"));
  }
  if (!plan && !spec.resume_from().empty()) ODYSSEY_RETURN_IF_ERROR(CheckResumeFrom(spec, *config, p, rl, *lora));
  return absl::OkStatus();
}

absl::Status ValidateCreateJobRequest(const v1::CreateJobRequest& request) {
  if (!request.has_spec()) return Invalid("spec", "is required");
  if (request.request_id().size() > 128) {
    return Invalid("request_id", absl::StrCat("length (", request.request_id().size(), ") must be <= 128 bytes"));
  }
  return ValidateJobSpec(request.spec(), "spec");
}

absl::Status ValidatePlanRequest(const v1::PlanRequest& request) {
  if (!request.has_spec()) return Invalid("spec", "is required");
  if (request.gpu_bytes() < 0) return Invalid("gpu_bytes", absl::StrCat("(", request.gpu_bytes(), ") must be >= 0"));
  if (request.host_bytes() < 0) {
    return Invalid("host_bytes", absl::StrCat("(", request.host_bytes(), ") must be >= 0"));
  }
  return ValidateJobSpec(request.spec(), "spec", SpecUse::kPlan);
}

// ---------------------------------------------------------------------------------------------
// TrainingService

namespace {

absl::Status CheckSequence(int64_t sequence) {
  if (sequence < 0) {
    return Invalid("sequence", absl::StrCat("(", sequence, ") must be >= 0 (0 = unordered, else 1, 2, 3, ... per job)"));
  }
  return absl::OkStatus();
}

absl::Status CheckBatch(const google::protobuf::RepeatedPtrField<v1::Datum>& batch, absl::string_view field) {
  if (batch.empty()) return Invalid(field, "is empty; at least one datum is required");
  if (batch.size() > kMaxBatchDatums) {
    return Invalid(field, absl::StrCat("has ", batch.size(), " datums; at most ", kMaxBatchDatums, " per call"));
  }
  return absl::OkStatus();
}

absl::Status CheckLoss(const v1::LossConfig& loss, absl::string_view f) {
  const std::string p(f);
  if (loss.kind().empty()) {
    return Invalid(p + ".kind", "is required: cross_entropy | importance_sampling | ppo");
  }
  if (loss.kind() != "cross_entropy" && loss.kind() != "importance_sampling" && loss.kind() != "ppo") {
    return Invalid(p + ".kind", absl::StrCat(Quote(loss.kind()), " is not a known loss: cross_entropy | "
                                             "importance_sampling | ppo"));
  }
  if (loss.clip_low() != 0 && !(loss.clip_low() > 0 && loss.clip_low() < 1)) {
    return Invalid(p + ".clip_low", absl::StrCat("(", loss.clip_low(), ") must be in (0, 1) (0 = 0.2)"));
  }
  if (loss.clip_high() != 0 && !(loss.clip_high() > 0 && loss.clip_high() <= 1e6)) {
    return Invalid(p + ".clip_high", absl::StrCat("(", loss.clip_high(), ") must be in (0, 1e6] (0 = 0.2)"));
  }
  return absl::OkStatus();
}

absl::Status CheckAdam(const v1::AdamWParams& adam, absl::string_view f) {
  const std::string p(f);
  if (!(adam.lr() > 0 && adam.lr() <= kMaxLearningRate)) {
    return Invalid(p + ".lr", absl::StrCat("(", adam.lr(), ") must be in (0, ", kMaxLearningRate, "]"));
  }
  if (!(adam.beta1() >= 0 && adam.beta1() < 1)) {
    return Invalid(p + ".beta1", absl::StrCat("(", adam.beta1(), ") must be in [0, 1) (0 with beta2 0 = 0.9)"));
  }
  if (!(adam.beta2() >= 0 && adam.beta2() < 1)) {
    return Invalid(p + ".beta2", absl::StrCat("(", adam.beta2(), ") must be in [0, 1) (0 with beta1 0 = 0.95)"));
  }
  if (!(adam.eps() >= 0) || !std::isfinite(adam.eps())) {
    return Invalid(p + ".eps", absl::StrCat("(", adam.eps(), ") must be >= 0 and finite (0 = 1e-8)"));
  }
  if (!(adam.weight_decay() >= 0) || !std::isfinite(adam.weight_decay())) {
    return Invalid(p + ".weight_decay", absl::StrCat("(", adam.weight_decay(), ") must be >= 0 and finite"));
  }
  return absl::OkStatus();
}

// A directory a worker reads or writes: absolute (the worker's working directory is no
// business of the client's), no NUL, bounded length.
absl::Status CheckDirectory(const std::string& dir, absl::string_view field, bool required) {
  if (dir.empty()) {
    return required ? Invalid(field, "is required (an absolute path readable by the session's worker)")
                    : absl::OkStatus();
  }
  if (dir.size() > kMaxPathBytes) {
    return Invalid(field, absl::StrCat("length (", dir.size(), ") must be <= ", kMaxPathBytes, " bytes"));
  }
  if (dir.find('\0') != std::string::npos) return Invalid(field, "must not contain NUL bytes");
  if (dir[0] != '/') return Invalid(field, absl::StrCat(Quote(dir), " must be an absolute path"));
  // The worker writes through a temp folder named after the last component plus a suffix, so
  // components stay well under the file systems' 255-byte name limit.
  for (absl::string_view part : absl::StrSplit(dir, '/')) {
    if (part.size() > kMaxPathComponentBytes) {
      return Invalid(field, absl::StrCat("a path component of ", part.size(), " bytes must be <= ",
                                         kMaxPathComponentBytes, " bytes"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateForwardBackwardRequest(const v1::ForwardBackwardRequest& request) {
  if (auto id = ParseJobName(request.job(), "job"); !id.ok()) return id.status();
  ODYSSEY_RETURN_IF_ERROR(CheckBatch(request.batch(), "batch"));
  ODYSSEY_RETURN_IF_ERROR(CheckLoss(request.loss(), "loss"));
  return CheckSequence(request.sequence());
}

absl::Status ValidateOptimStepRequest(const v1::OptimStepRequest& request) {
  if (auto id = ParseJobName(request.job(), "job"); !id.ok()) return id.status();
  ODYSSEY_RETURN_IF_ERROR(CheckAdam(request.adam(), "adam"));
  return CheckSequence(request.sequence());
}

absl::Status ValidateForwardRequest(const v1::ForwardRequest& request) {
  if (auto id = ParseJobName(request.job(), "job"); !id.ok()) return id.status();
  ODYSSEY_RETURN_IF_ERROR(CheckBatch(request.batch(), "batch"));
  return CheckSequence(request.sequence());
}

absl::Status ValidateSaveCheckpointRequest(const v1::SaveCheckpointRequest& request) {
  if (auto id = ParseJobName(request.job(), "job"); !id.ok()) return id.status();
  ODYSSEY_RETURN_IF_ERROR(CheckDirectory(request.directory(), "directory", /*required=*/false));
  return CheckSequence(request.sequence());
}

absl::Status ValidateLoadCheckpointRequest(const v1::LoadCheckpointRequest& request) {
  if (auto id = ParseJobName(request.job(), "job"); !id.ok()) return id.status();
  ODYSSEY_RETURN_IF_ERROR(CheckDirectory(request.directory(), "directory", /*required=*/true));
  return CheckSequence(request.sequence());
}

absl::Status ValidateExportWeightsRequest(const v1::ExportWeightsRequest& request) {
  if (auto id = ParseJobName(request.job(), "job"); !id.ok()) return id.status();
  ODYSSEY_RETURN_IF_ERROR(CheckDirectory(request.directory(), "directory", /*required=*/true));
  ODYSSEY_RETURN_IF_ERROR(OneOf("dtype", request.dtype(), {"float32", "bfloat16"}));
  return CheckSequence(request.sequence());
}

absl::Status ValidateSampleRequest(const v1::SampleRequest& request) {
  if (auto id = ParseJobName(request.job(), "job"); !id.ok()) return id.status();
  if (request.prompts().empty()) return Invalid("prompts", "is empty; at least one prompt is required");
  if (request.prompts_size() > kMaxBatchDatums) {
    return Invalid("prompts", absl::StrCat("has ", request.prompts_size(), " prompts; at most ", kMaxBatchDatums,
                                           " per call"));
  }
  return CheckSequence(request.sequence());
}

absl::Status ValidateRolloutBatch(const v1::RolloutBatch& batch) {
  if (auto id = ParseJobName(batch.job(), "job"); !id.ok()) return id.status();
  ODYSSEY_RETURN_IF_ERROR(CheckBatch(batch.batch(), "batch"));
  ODYSSEY_RETURN_IF_ERROR(CheckLoss(batch.loss(), "loss"));
  return CheckAdam(batch.adam(), "adam");
}

// ---------------------------------------------------------------------------------------------
// Path confinement

absl::Status CheckJobSpecPaths(const v1::JobSpec& spec, const PathPolicy& policy, absl::string_view tenant,
                               absl::string_view f) {
  using Access = PathPolicy::Access;
  const std::string p(f);
  const std::string& model = spec.model().name();
  if (model.find('/') != std::string::npos) {
    ODYSSEY_RETURN_IF_ERROR(policy.Check(model, Access::kRead, tenant, p + ".model.name"));
  } else if (policy.enabled() && !model.empty()) {
    // A bare name is a named shape, or a folder relative to a process's working folder: the
    // latter is not confinable.
    const std::vector<std::string> shapes = odyssey::model::NamedShapeNames();
    if (std::find(shapes.begin(), shapes.end(), model) == shapes.end()) {
      return Invalid(p + ".model.name", absl::StrCat(Quote(model), " must be a named shape (", absl::StrJoin(shapes, ", "),
                                                     ") or an absolute checkpoint directory"));
    }
  }
  if (!spec.data().path().empty()) {
    ODYSSEY_RETURN_IF_ERROR(policy.Check(spec.data().path(), Access::kRead, tenant, p + ".data.path"));
  }
  if (!spec.checkpoint().directory().empty()) {
    ODYSSEY_RETURN_IF_ERROR(
        policy.Check(spec.checkpoint().directory(), Access::kWrite, tenant, p + ".checkpoint.directory"));
  }
  if (!spec.resume_from().empty()) {
    ODYSSEY_RETURN_IF_ERROR(policy.Check(spec.resume_from(), Access::kRead, tenant, p + ".resume_from"));
  }
  return absl::OkStatus();
}

absl::Status CheckTrainingCallPaths(const v1::TrainingCall& call, const PathPolicy& policy,
                                    absl::string_view tenant) {
  using Access = PathPolicy::Access;
  switch (call.call_case()) {
    case v1::TrainingCall::kSaveCheckpoint:
      if (call.save_checkpoint().directory().empty()) return absl::OkStatus();
      return policy.Check(call.save_checkpoint().directory(), Access::kWrite, tenant, "directory");
    case v1::TrainingCall::kLoadCheckpoint:
      return policy.Check(call.load_checkpoint().directory(), Access::kRead, tenant, "directory");
    case v1::TrainingCall::kExportWeights:
      return policy.Check(call.export_weights().directory(), Access::kWrite, tenant, "directory");
    default:
      return absl::OkStatus();
  }
}

absl::Status ValidateListJobsRequest(const v1::ListJobsRequest& request) {
  if (request.page_size() < 0 || request.page_size() > kMaxPageSize) {
    return Invalid("page_size", absl::StrCat("(", request.page_size(), ") must be in [0, ", kMaxPageSize,
                                             "] (0 = ", kDefaultPageSize, ")"));
  }
  if (!request.page_token().empty()) {
    int64_t id = 0;
    if (!absl::SimpleAtoi(request.page_token(), &id) || id <= 0) {
      return Invalid("page_token", absl::StrCat(Quote(request.page_token()), " is not a token returned by ListJobs"));
    }
  }
  if (!v1::Job::State_IsValid(request.state())) {
    return Invalid("state", absl::StrCat("(", static_cast<int>(request.state()), ") is not a Job.State"));
  }
  return absl::OkStatus();
}

absl::Status ValidateListJobEventsRequest(const v1::ListJobEventsRequest& request) {
  if (request.page_size() < 0 || request.page_size() > kMaxEventPageSize) {
    return Invalid("page_size", absl::StrCat("(", request.page_size(), ") must be in [0, ", kMaxEventPageSize,
                                             "] (0 = ", kDefaultEventPageSize, ")"));
  }
  if (!request.page_token().empty()) {
    int64_t seq = 0;
    if (!absl::SimpleAtoi(request.page_token(), &seq) || seq <= 0) {
      return Invalid("page_token",
                     absl::StrCat(Quote(request.page_token()), " is not a token returned by ListJobEvents"));
    }
  }
  return absl::OkStatus();
}

}  // namespace odyssey::server
