#include "planner/memory_spec.h"

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

namespace odyssey::planner {
namespace {

// Every MemorySpec field reaches the fields, set or unset as the proto documents.
TEST(MemorySpecTest, UnsetFieldsStayUnsetAndSetOnesArrive) {
  v1::MemorySpec m;
  absl::StatusOr<MemoryFields> none = MemoryFieldsFromProto(m);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE(none->recompute || none->every_k || none->offload || none->device_resident || none->mlp_tile ||
               none->loss_tile || none->head_groups || none->keep_attention || none->optimizer_on_host ||
               none->keep_selection || none->bf16_moments);
  EXPECT_EQ(none->ApplyTo(MemoryStrategy{}), MemoryStrategy{});
  m.set_offload("auto");
  EXPECT_FALSE(MemoryFieldsFromProto(m)->offload);

  m.set_recompute("layer");
  m.set_offload("on");
  m.set_mlp_tile_tokens(4096);
  m.set_loss_tile_tokens(1024);
  m.set_host_budget_bytes(int64_t{5} << 30);
  m.set_device_resident(3);
  m.set_attention_head_groups(2);
  m.set_keep_attention(true);
  m.set_optimizer_on_host(true);
  m.set_keep_selection(true);
  m.set_bf16_moments(true);
  m.set_recompute_every_k(4);
  absl::StatusOr<MemoryFields> f = MemoryFieldsFromProto(m);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE(f->AllSet());
  const MemoryStrategy s = f->ApplyTo(MemoryStrategy{});
  EXPECT_EQ(s.recompute, Recompute::kLayer);
  EXPECT_EQ(s.every_k, 4);
  EXPECT_TRUE(s.offload);
  EXPECT_EQ(s.device_resident, 3);
  EXPECT_EQ(s.mlp_tile, 4096);
  EXPECT_EQ(s.loss_tile, 1024);
  EXPECT_EQ(s.host_budget_bytes, int64_t{5} << 30);
  EXPECT_EQ(s.head_groups, 2);
  EXPECT_TRUE(s.keep_attention);
  EXPECT_TRUE(s.optimizer_on_host);
  EXPECT_TRUE(s.keep_selection);
  EXPECT_TRUE(s.bf16_moments);

  // The proto written back from the strategy reads as the same strategy.
  v1::MemorySpec back;
  MemoryStrategyToProto(s, &back);
  EXPECT_EQ(MemoryFieldsFromProto(back)->ApplyTo(MemoryStrategy{}), s);
}

// Bad values are refused naming the field (by its proto name) and the rule.
TEST(MemorySpecTest, RefusalsNameTheFieldAndTheRule) {
  struct Case {
    std::function<void(v1::MemorySpec&)> set;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](v1::MemorySpec& m) { m.set_recompute("sometimes"); }, "spec.memory.recompute: 'sometimes' is not one of"},
      {[](v1::MemorySpec& m) { m.set_recompute("every_k"); }, "spec.memory.recompute_every_k: (0) must be > 0"},
      {[](v1::MemorySpec& m) { m.set_recompute_every_k(1); }, "spec.memory.recompute_every_k: (1) must be >= 2"},
      {[](v1::MemorySpec& m) { m.set_offload("sometimes"); },
       "spec.memory.offload: ('sometimes') must be on, off, auto or empty"},
      {[](v1::MemorySpec& m) { m.set_mlp_tile_tokens(-1); }, "spec.memory.mlp_tile_tokens: (-1) must be >= 0"},
      {[](v1::MemorySpec& m) { m.set_loss_tile_tokens(-2); }, "spec.memory.loss_tile_tokens: (-2) must be >= 0"},
      {[](v1::MemorySpec& m) { m.set_host_budget_bytes(-3); }, "spec.memory.host_budget_bytes: (-3) must be >= 0"},
      {[](v1::MemorySpec& m) { m.set_device_resident(-1); }, "spec.memory.device_resident: (-1) must be >= 0"},
      {[](v1::MemorySpec& m) {
         m.set_offload("off");
         m.set_device_resident(2);
       },
       "spec.memory.device_resident: is set but memory.offload is \"off\""},
      {[](v1::MemorySpec& m) { m.set_attention_head_groups(-1); }, "spec.memory.attention_head_groups: (-1) must be >= 0"},
      {[](v1::MemorySpec& m) {
         m.set_recompute("every_k");
         m.set_recompute_every_k(2);
         m.set_keep_attention(true);
       },
       "spec.memory.keep_attention: needs memory.recompute \"layer\""},
      {[](v1::MemorySpec& m) {
         m.set_recompute("none");
         m.set_offload("on");
       },
       "spec.memory.offload: \"on\" needs memory.recompute"},
      {[](v1::MemorySpec& m) {
         m.set_recompute("none");
         m.set_keep_selection(true);
       },
       "spec.memory.keep_selection: needs memory.recompute \"layer\" or \"every_k\""},
      {[](v1::MemorySpec& m) {
         m.set_optimizer_on_host(false);
         m.set_bf16_moments(true);
       },
       "spec.memory.bf16_moments: needs memory.optimizer_on_host"},
  };
  for (const Case& c : cases) {
    v1::MemorySpec m;
    c.set(m);
    absl::StatusOr<MemoryFields> f = MemoryFieldsFromProto(m);
    ASSERT_FALSE(f.ok()) << c.message;
    EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(f.status().message().find(c.message), std::string::npos) << f.status();
  }
}

v1::JobSpec Spec3B(int64_t seq_len);

// A field set alone acts: device_resident without offload makes the planner offload (it counts
// offloaded inputs kept on the GPU), and where nothing chooses (a CPU worker applies the fields
// over the defaults) it is refused, naming the field, rather than ignored.
// JobSpec.lora arrives as set, and each refusal names spec.lora.<field> and the rule.
TEST(MemorySpecTest, LoraSpecArrivesOrIsRefusedByName) {
  v1::LoraSpec spec;
  auto none = LoraFromProto(spec);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE(none->enabled());
  spec.set_rank(8);
  spec.set_alpha(16);
  spec.add_target_modules("v_proj");
  spec.add_target_modules("q_proj");
  spec.set_merge(true);
  auto lora = LoraFromProto(spec);
  ASSERT_TRUE(lora.ok()) << lora.status();
  EXPECT_EQ(lora->rank, 8);
  EXPECT_EQ(lora->scale(), 2.0);
  EXPECT_TRUE(lora->merge);
  EXPECT_EQ(lora->Targets(), (std::vector<std::string>{"q_proj", "v_proj"}));
  struct Case {
    std::function<void(v1::LoraSpec&)> set;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](v1::LoraSpec& l) { l.set_rank(-1); }, "spec.lora.rank: (-1) must be in [0, 1024]"},
      {[](v1::LoraSpec& l) { l.set_rank(0); }, "spec.lora.rank: (0) must be > 0 when other spec.lora fields are set"},
      {[](v1::LoraSpec& l) { l.set_alpha(-2); }, "spec.lora.alpha: (-2) must be >= 0 and finite"},
      {[](v1::LoraSpec& l) { l.set_dropout(0.05); }, "spec.lora.dropout: (0.05) must be 0"},
      {[](v1::LoraSpec& l) { l.add_target_modules("embed_tokens"); },
       "spec.lora.target_modules[2]: (\"embed_tokens\") must be one of q_proj, k_proj"},
      {[](v1::LoraSpec& l) { l.add_target_modules("q_proj"); }, "spec.lora.target_modules[2]: (\"q_proj\") is named twice"},
  };
  for (const Case& c : cases) {
    v1::LoraSpec bad = spec;
    c.set(bad);
    auto r = LoraFromProto(bad);
    ASSERT_FALSE(r.ok()) << c.message;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(c.message), std::string::npos) << r.status();
  }
}

TEST(MemorySpecTest, DeviceResidentAloneActsOrIsRefused) {
  v1::JobSpec spec = Spec3B(65536);
  spec.mutable_memory()->set_device_resident(2);
  absl::StatusOr<JobPlan> plan = PlanJobSpec(spec, Hardware{});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->strategy.offload);
  EXPECT_EQ(plan->strategy.device_resident, 2);
  const absl::Status cpu = MemoryFieldsFromProto(spec.memory())->ApplyTo(MemoryStrategy{}).Validate();
  EXPECT_EQ(cpu.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(cpu.message().find("memory.device_resident (2) needs memory.offload on"), std::string::npos) << cpu;
}

v1::JobSpec Spec3B(int64_t seq_len) {
  v1::JobSpec spec;
  spec.mutable_model()->set_name("llama-3.2-3b");
  spec.mutable_data()->set_seq_len(seq_len);
  spec.mutable_data()->set_batch_size(1);
  return spec;
}

// PlanJobSpec reads the spec's model, dtype, length and memory; the model's limits on the
// fields are refused naming the JobSpec field.
TEST(MemorySpecTest, PlanJobSpecReadsTheSpec) {
  const Hardware h200;
  absl::StatusOr<JobPlan> bf16 = PlanJobSpec(Spec3B(262144), h200);
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  EXPECT_TRUE(bf16->fits);
  v1::JobSpec fp32 = Spec3B(262144);
  fp32.mutable_model()->set_dtype("float32");
  fp32.mutable_memory()->set_recompute("layer");
  fp32.mutable_memory()->set_offload("off");
  v1::JobSpec bf16_fixed = fp32;
  bf16_fixed.mutable_model()->set_dtype("bfloat16");
  EXPECT_GT(PlanJobSpec(fp32, h200)->prediction.gpu_peak_bytes, PlanJobSpec(bf16_fixed, h200)->prediction.gpu_peak_bytes);

  v1::JobSpec groups = Spec3B(65536);
  groups.mutable_memory()->set_attention_head_groups(3);
  absl::StatusOr<JobPlan> bad = PlanJobSpec(groups, h200);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("spec.memory.attention_head_groups: (3) must divide the model's "
                                        "num_key_value_heads (8)"),
            std::string::npos)
      << bad.status();
  v1::JobSpec deep = Spec3B(65536);
  deep.mutable_memory()->set_recompute("every_k");
  deep.mutable_memory()->set_recompute_every_k(29);
  EXPECT_NE(PlanJobSpec(deep, h200).status().message().find("spec.memory.recompute_every_k: (29) must be <= the "
                                                            "model's num_hidden_layers (28)"),
            std::string::npos);
  v1::JobSpec missing = Spec3B(65536);
  missing.mutable_model()->set_name("/nowhere/model");
  EXPECT_EQ(PlanJobSpec(missing, h200).status().code(), absl::StatusCode::kInvalidArgument);

  // The host budget rule: the spec's budget wins, else 85% of the host.
  EXPECT_EQ(MachineHardware(int64_t{80} << 30, int64_t{100} << 30, 0).host_bytes, int64_t{85} << 30);
  EXPECT_EQ(MachineHardware(int64_t{80} << 30, int64_t{100} << 30, int64_t{7} << 30).host_bytes, int64_t{7} << 30);
  EXPECT_EQ(MachineHardware(int64_t{80} << 30, int64_t{100} << 30, 0).gpu_bytes, int64_t{77} << 30);
  // A host budget too small for the offloaded inputs: the planner keeps them on the GPU or
  // nests the checkpoints, and the plan's strategy carries the budget.
  v1::JobSpec small_host = Spec3B(524288);
  small_host.mutable_memory()->set_host_budget_bytes(int64_t{8} << 30);
  absl::StatusOr<JobPlan> p = PlanJobSpec(small_host, MachineHardware(int64_t{139} << 30, int64_t{128} << 30, int64_t{8} << 30));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_LE(p->prediction.host_bytes, int64_t{8} << 30);
  EXPECT_EQ(p->strategy.host_budget_bytes, int64_t{8} << 30);
}

// With the optimizer on the host an SFT job's layers' gradients leave the GPU with their
// backward, data-parallel replicas' too (after their all-reduce); an RL session's and
// context-parallel ranks' stay to the step (GradientsToStep): their plans hold them as the device
// optimizer's does, and the same spec as an RL session plans more GPU memory than as SFT.
TEST(MemorySpecTest, GradientsStayToTheStepWhereNothingIsSentEarly) {
  EXPECT_FALSE(GradientsToStep(false, 1));
  EXPECT_TRUE(GradientsToStep(true, 1));
  EXPECT_TRUE(GradientsToStep(false, 2));
  const Hardware h200;
  v1::JobSpec sft = Spec3B(65536);
  sft.mutable_memory()->set_recompute("layer");
  sft.mutable_memory()->set_offload("on");
  sft.mutable_memory()->set_optimizer_on_host(true);
  v1::JobSpec rl = sft;
  rl.set_kind(v1::RL_SESSION);
  absl::StatusOr<JobPlan> a = PlanJobSpec(sft, h200), b = PlanJobSpec(rl, h200);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  auto term = [](const JobPlan& p, const std::string& name) {
    for (const auto& [n, bytes] : p.prediction.terms)
      if (n == name) return bytes;
    return int64_t{-1};
  };
  EXPECT_GT(b->prediction.gpu_peak_bytes, a->prediction.gpu_peak_bytes);
  // Replicas (unsharded) plan as one rank: their gradients leave with the backward too.
  v1::JobSpec dp = sft;
  dp.mutable_parallel()->set_world_size(2);
  absl::StatusOr<JobPlan> d = PlanJobSpec(dp, h200);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->prediction.gpu_peak_bytes, a->prediction.gpu_peak_bytes) << d->prediction.Describe();
  const int64_t layer_grads = term(*b, "gradients so far");
  EXPECT_GT(layer_grads, int64_t{5} << 30) << b->prediction.Describe();  // 27 of 28 layers' bf16 gradients
  EXPECT_LT(term(*a, "gradients so far"), int64_t{1} << 30) << a->prediction.Describe();
}

// Context parallel: one rank holds seq_len / context_parallel positions, and is planned so.
TEST(MemorySpecTest, ContextParallelPlansOneRanksShardOfTheSequence) {
  const Hardware h200;
  v1::JobSpec cp = Spec3B(2 << 20);
  cp.mutable_parallel()->set_world_size(4);
  cp.mutable_parallel()->set_context_parallel(4);
  EXPECT_EQ(RankSeqLen(cp), 524288);
  absl::StatusOr<JobPlan> sharded = PlanJobSpec(cp, h200);
  absl::StatusOr<JobPlan> quarter = PlanJobSpec(Spec3B(524288), h200);
  ASSERT_TRUE(sharded.ok() && quarter.ok());
  EXPECT_EQ(sharded->prediction.gpu_peak_bytes, quarter->prediction.gpu_peak_bytes);
  EXPECT_TRUE(sharded->fits);
  EXPECT_FALSE(PlanJobSpec(Spec3B(2 << 20), h200)->fits);  // the whole 2M on one GPU does not
}

}  // namespace
}  // namespace odyssey::planner
