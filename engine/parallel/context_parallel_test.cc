// Context-parallel training through the Trainer on thread-ranks (fp32, CPU): P = 2 and 4 ranks
// holding S/P positions each take the step one rank takes on whole rows (loss, gradient norm,
// weights after the update within 1e-5), with the tiny model's GQA (2 KV heads: = P at P = 2,
// replicated at P = 4), packed documents whose boundaries fall inside shards (global RoPE
// positions, labels crossing shard boundaries), head-chunked rounds, and every memory strategy;
// and an RL session's calls (whole batches on every rank, padded rows sharded) equal one rank's.
#include "engine/parallel/context_parallel.h"

#include <cmath>
#include <functional>
#include <thread>
#include <utility>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "engine/parallel/communicator.h"
#include "model/hybrid.h"
#include "engine/rl_test_batch.h"
#include "engine/parallel/parallel_testing.h"
#include "engine/trainer.h"

namespace odyssey::engine {
namespace {

using parallel_testing::CopyWeights;
using parallel_testing::ExpectWeightsEqual;
using parallel_testing::ExpectGradientsClose;

TrainerOptions Tiny() {
  TrainerOptions o;
  o.model = "tiny";  // 4 query heads, 2 KV heads
  o.device = "cpu";
  o.dtype = "float32";
  o.attention = "math";
  o.steps = 10;
  o.optimizer.lr = 1e-3;
  o.optimizer.weight_decay = 0.1;
  o.schedule.warmup_steps = 1;
  o.grad_clip = 0.5;  // low enough to clip: clipping must see the reduced gradients
  o.data.format = "kjv";
  o.data.seq_len = 64;
  o.data.batch_size = 2;
  o.seed = 5;
  return o;
}

// Packs each row of a stream batch into documents of `lens` (positions restarting per
// document, the last document's targets masked after its end as jsonl rows do), so that
// document boundaries fall inside the shards at P = 2 and 4.
Batch Packed(Batch b, const std::vector<int64_t>& lens) {
  const int64_t B = b.input_ids.size(0);
  b.doc_lens.assign(static_cast<size_t>(B), lens);
  b.position_ids = b.position_ids.clone();
  b.loss_mask = b.loss_mask.clone();
  for (int64_t row = 0; row < B; ++row) {
    int64_t start = 0;
    for (int64_t len : lens) {
      b.position_ids[row].narrow(0, start, len).copy_(torch::arange(len, torch::kInt64));
      b.loss_mask[row][start + len - 1] = 0;  // a document's last token predicts nothing
      start += len;
    }
  }
  return b;
}

// P thread-ranks of one context-parallel group, each with its trainer.
struct Group {
  std::vector<std::unique_ptr<Communicator>> comms;
  std::vector<std::unique_ptr<Trainer>> ranks;

  // Runs fn(rank) on each rank's thread.
  void Run(const std::function<void(int)>& fn) {
    std::vector<std::thread> threads;
    for (int r = 0; r < static_cast<int>(ranks.size()); ++r) threads.emplace_back(fn, r);
    for (auto& t : threads) t.join();
  }
};

Group MakeGroup(int P, const TrainerOptions& base) {
  Group g;
  auto group = InProcessGroup::Create(P, absl::Seconds(120));
  for (int r = 0; r < P; ++r) g.comms.push_back(group->Rank(r));
  g.ranks.resize(static_cast<size_t>(P));
  std::vector<absl::Status> created(static_cast<size_t>(P));
  g.Run([&](int r) {
    TrainerOptions o = base;
    o.context_parallel.group = g.comms[static_cast<size_t>(r)].get();
    auto t = Trainer::Create(o);
    created[static_cast<size_t>(r)] = t.status();
    if (t.ok()) g.ranks[static_cast<size_t>(r)] = *std::move(t);
  });
  for (const absl::Status& s : created) EXPECT_TRUE(s.ok()) << s;
  return g;
}

// Steps P ranks and one rank on the same batches; every step's loss and norm and the weights
// after it agree. Tolerances: fp32, the ranks sum the same per-token terms in another order
// (shards, then the all-reduce); 1e-5 relative, as the data-parallel test.
// `warm`: one step of the ranks first (LoRA's B starts at zero, and with it A's gradient).
void ExpectEqualsOneRank(int P, const TrainerOptions& options, bool packed, const std::string& what,
                         bool warm = false) {
  TrainerOptions one = options;
  one.context_parallel = ContextParallelOptions{};
  auto single = Trainer::Create(one);
  ASSERT_TRUE(single.ok()) << single.status();
  Group g = MakeGroup(P, options);
  for (const auto& t : g.ranks) ASSERT_TRUE(t);
  if (warm) {
    const Batch first = (*single)->data().Next();
    std::vector<StepResult> warmed(static_cast<size_t>(P));
    g.Run([&](int r) { warmed[static_cast<size_t>(r)] = g.ranks[static_cast<size_t>(r)]->Step(first); });
    for (const StepResult& w : warmed) ASSERT_TRUE(w.status.ok()) << what << ": " << w.status;
  }
  CopyWeights(*g.ranks[0], **single);
  for (int step = 0; step < 2; ++step) {
    Batch batch = (*single)->data().Next();
    if (packed) batch = Packed(batch, {13, 29, 22});
    const std::string at = what + " P " + std::to_string(P) + " step " + std::to_string(step);
    // The gradients a step would apply, then the step itself.
    std::vector<absl::StatusOr<BatchGradients>> grads(static_cast<size_t>(P), absl::UnknownError("not run"));
    g.Run([&](int r) { grads[static_cast<size_t>(r)] = g.ranks[static_cast<size_t>(r)]->Gradients(batch); });
    absl::StatusOr<BatchGradients> want_grads = (*single)->Gradients(batch);
    ASSERT_TRUE(want_grads.ok()) << want_grads.status();
    // The DSA indexer's gradients (the hybrid family) are its KL's, target - softmax per entry:
    // differences of fp32 values near 1 whose target the ranks sum in another order (their
    // heads' shares, then the all-reduce). Relative to their largest entry they move by up to
    // ~2e-5 in fp32 (the layer test in fp64 holds them to fp32's rounding of the KL alone).
    auto split = [](const BatchGradients& g, bool indexer) {
      BatchGradients part;
      part.loss = g.loss;
      for (const auto& [name, t] : g.grads)
        if ((name.find(".indexer.") != std::string::npos) == indexer) part.grads[name] = t;
      return part;
    };
    for (int r = 0; r < P; ++r) {
      ASSERT_TRUE(grads[static_cast<size_t>(r)].ok()) << at << ": " << grads[static_cast<size_t>(r)].status();
      const std::string rank = at + " rank " + std::to_string(r);
      ExpectGradientsClose(split(*grads[static_cast<size_t>(r)], false), split(*want_grads, false), 1e-5, rank);
      ExpectGradientsClose(split(*grads[static_cast<size_t>(r)], true), split(*want_grads, true), 1e-4, rank);
    }
    std::vector<StepResult> results(static_cast<size_t>(P));
    g.Run([&](int r) { results[static_cast<size_t>(r)] = g.ranks[static_cast<size_t>(r)]->Step(batch); });
    StepResult want = (*single)->Step(batch);
    for (int r = 0; r < P; ++r) {
      const StepResult& got = results[static_cast<size_t>(r)];
      ASSERT_TRUE(got.status.ok()) << at << ": " << got.status;
      EXPECT_NEAR(got.loss, want.loss, 1e-5 * want.loss) << at << " rank " << r;
      EXPECT_NEAR(got.grad_norm, want.grad_norm, 1e-5 * want.grad_norm) << at << " rank " << r;
      EXPECT_EQ(got.tokens, want.tokens) << at;
      EXPECT_EQ(got.target_tokens, want.target_tokens) << at;
      EXPECT_EQ(got.loss, results[0].loss) << at << ": the ranks agree bitwise";
    }
    for (int r = 1; r < P; ++r) ExpectWeightsEqual(*g.ranks[0], *g.ranks[static_cast<size_t>(r)], at + " ranks");
    // The ranks' update is AdamW on the gradients compared above. Its result is not compared
    // with one rank's: an entry whose gradient is near AdamW's eps turns fp32 rounding into
    // update differences of up to 2 lr (seen: 5e-5 at lr 1e-3). The next step starts both
    // from the ranks' weights, so its gradients compare the parallel math again.
    CopyWeights(*g.ranks[0], **single);
  }
  // Evaluation sums the shards too.
  Batch batch = (*single)->data().Next();
  std::vector<double> evals(static_cast<size_t>(P));
  g.Run([&](int r) { evals[static_cast<size_t>(r)] = g.ranks[static_cast<size_t>(r)]->EvalLoss(batch); });
  const double want = (*single)->EvalLoss(batch);
  for (double e : evals) EXPECT_NEAR(e, want, 1e-5 * want) << what << " eval";
}

TEST(ContextParallelTest, ShardBatchKeepsGlobalPositionsAndLabels) {
  TrainerOptions o = Tiny();
  auto t = Trainer::Create(o);
  ASSERT_TRUE(t.ok());
  const Batch whole = Packed((*t)->data().Next(), {13, 29, 22});
  for (int64_t r = 0; r < 4; ++r) {
    const Batch s = ShardBatch(whole, r, 4);
    EXPECT_TRUE(torch::equal(s.input_ids, whole.input_ids.narrow(1, 16 * r, 16)));
    EXPECT_TRUE(torch::equal(s.labels, whole.labels.narrow(1, 16 * r, 16)));
    EXPECT_TRUE(torch::equal(s.position_ids, whole.position_ids.narrow(1, 16 * r, 16)));
    EXPECT_EQ(s.doc_lens, whole.doc_lens);
  }
  // The label of a shard's last position is the next shard's first token.
  EXPECT_EQ(ShardBatch(whole, 0, 4).labels[0][15].item<int64_t>(),
            ShardBatch(whole, 1, 4).input_ids[0][0].item<int64_t>());
}

TEST(ContextParallelTest, TwoAndFourRanksEqualOneRank) {
  torch::set_num_threads(1);
  for (int P : {2, 4}) {
    ExpectEqualsOneRank(P, Tiny(), /*packed=*/false, "plain");
    ExpectEqualsOneRank(P, Tiny(), /*packed=*/true, "packed");
  }
}

TEST(ContextParallelTest, HeadChunkedRoundsEqualOneRank) {
  torch::set_num_threads(1);
  TrainerOptions o = Tiny();
  o.context_parallel.head_chunk = 2;
  ExpectEqualsOneRank(2, o, false, "head_chunk 2");
  ExpectEqualsOneRank(2, o, true, "head_chunk 2 packed");
  o.context_parallel.head_chunk = 4;
  ExpectEqualsOneRank(4, o, false, "head_chunk 4");
}

// Each memory strategy on the shards: recompute (per layer, nested every k), offload of the
// saved inputs, tiled MLP and loss, kept attention outputs (with and without head rounds).
TEST(ContextParallelTest, MemoryStrategiesOnShardsEqualOneRank) {
  torch::set_num_threads(1);
  struct Case {
    std::string name;
    std::function<void(TrainerOptions&)> set;
  };
  const std::vector<Case> cases = {
      {"recompute layer", [](TrainerOptions& o) { o.memory.recompute = planner::Recompute::kLayer; }},
      {"recompute every_k 2",
       [](TrainerOptions& o) {
         o.memory.recompute = planner::Recompute::kEveryK;
         o.memory.every_k = 2;
       }},
      {"offload",
       [](TrainerOptions& o) {
         o.memory.recompute = planner::Recompute::kLayer;
         o.memory.offload = true;
         o.memory.device_resident = 1;
       }},
      {"tiled mlp and loss",
       [](TrainerOptions& o) {
         o.memory.mlp_tile = 5;  // tiles that do not divide the shard
         o.memory.loss_tile = 7;
       }},
      {"kept attention",
       [](TrainerOptions& o) {
         o.memory.recompute = planner::Recompute::kLayer;
         o.memory.keep_attention = true;
       }},
      {"kept attention, head rounds",
       [](TrainerOptions& o) {
         o.memory.recompute = planner::Recompute::kLayer;
         o.memory.keep_attention = true;
         o.context_parallel.head_chunk = 2;
       }},
      {"everything",
       [](TrainerOptions& o) {
         o.memory.recompute = planner::Recompute::kLayer;
         o.memory.offload = true;
         o.memory.mlp_tile = 6;
         o.memory.loss_tile = 9;
         o.memory.keep_attention = true;
       }},
  };
  for (const Case& c : cases) {
    TrainerOptions o = Tiny();
    c.set(o);
    ExpectEqualsOneRank(2, o, /*packed=*/true, c.name);
  }
  TrainerOptions o = Tiny();
  cases.back().set(o);
  ExpectEqualsOneRank(4, o, /*packed=*/true, "everything");
}

// 2 data-parallel replicas of context-parallel pairs (rank r in CP group r / 2 and data group
// r % 2, ConnectRankLayout's layout) beside the reference: 2 data-parallel ranks on whole rows,
// all from ranks[0]'s weights.
struct DpOverCp {
  static constexpr int kP = 2, kD = 2, kW = kP * kD;
  std::vector<std::unique_ptr<Communicator>> comms;  // each keeps its thread group alive
  std::vector<std::unique_ptr<Trainer>> ref, ranks;  // kD, kW; null where Create failed

  // Runs fn(r) for r in [0, n) on n threads.
  static void On(int n, const std::function<void(int)>& fn) {
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) threads.emplace_back(fn, r);
    for (auto& t : threads) t.join();
  }
};

DpOverCp MakeDpOverCp(const TrainerOptions& o) {
  using L = DpOverCp;
  DpOverCp l;
  auto dp_only = InProcessGroup::Create(L::kD, absl::Seconds(120));
  std::vector<std::shared_ptr<InProcessGroup>> cp_groups, dp_groups;
  for (int g = 0; g < L::kD; ++g) cp_groups.push_back(InProcessGroup::Create(L::kP, absl::Seconds(120)));
  for (int g = 0; g < L::kP; ++g) dp_groups.push_back(InProcessGroup::Create(L::kD, absl::Seconds(120)));
  std::vector<Communicator*> ref_comm, cp_comm, dp_comm;
  auto keep = [&](std::unique_ptr<Communicator> c) {
    l.comms.push_back(std::move(c));
    return l.comms.back().get();
  };
  for (int r = 0; r < L::kD; ++r) ref_comm.push_back(keep(dp_only->Rank(r)));
  for (int r = 0; r < L::kW; ++r) {
    cp_comm.push_back(keep(cp_groups[static_cast<size_t>(r / L::kP)]->Rank(r % L::kP)));
    dp_comm.push_back(keep(dp_groups[static_cast<size_t>(r % L::kP)]->Rank(r / L::kP)));
  }
  l.ref.resize(L::kD);
  l.ranks.resize(L::kW);
  L::On(L::kD, [&](int r) {
    TrainerOptions t = o;
    t.communicator = ref_comm[static_cast<size_t>(r)];
    auto made = Trainer::Create(t);
    if (made.ok()) l.ref[static_cast<size_t>(r)] = *std::move(made);
  });
  L::On(L::kW, [&](int r) {
    TrainerOptions t = o;
    t.communicator = dp_comm[static_cast<size_t>(r)];
    t.context_parallel.group = cp_comm[static_cast<size_t>(r)];
    auto made = Trainer::Create(t);
    if (made.ok()) l.ranks[static_cast<size_t>(r)] = *std::move(made);
  });
  if (l.ranks[0])
    for (const auto& t : l.ref)
      if (t) CopyWeights(*l.ranks[0], *t);
  return l;
}

// Data parallel over context-parallel groups: 2 replicas of CP groups of 2 (rank r in CP group
// r / 2 and data group r % 2, ConnectRankLayout's layout) take the step 2 data-parallel ranks on
// whole rows take on the same two batches: gradients, loss and norm within 1e-5; the ranks end
// bitwise alike.
TEST(ContextParallelTest, DataParallelOverContextGroupsEqualsDataParallel) {
  torch::set_num_threads(1);
  TrainerOptions o = Tiny();
  o.memory.recompute = planner::Recompute::kLayer;
  o.memory.loss_tile = 9;
  constexpr int kP = DpOverCp::kP, kD = DpOverCp::kD, kW = DpOverCp::kW;
  DpOverCp layout = MakeDpOverCp(o);
  for (const auto& t : layout.ref) ASSERT_TRUE(t);
  for (const auto& t : layout.ranks) ASSERT_TRUE(t);
  std::vector<std::unique_ptr<Trainer>>& ref = layout.ref;
  std::vector<std::unique_ptr<Trainer>>& ranks = layout.ranks;
  const auto& on = DpOverCp::On;
  // Data-parallel rank g's batches: its own stream (the data seed plus its data rank), the same
  // for both ranks of CP group g.
  std::vector<Batch> batches = {ref[0]->data().Next(), ref[1]->data().Next()};
  for (int g = 0; g < kD; ++g)
    EXPECT_TRUE(torch::equal(ranks[static_cast<size_t>(g * kP)]->data().Next().input_ids,
                             batches[static_cast<size_t>(g)].input_ids))
        << "CP group " << g << " reads data rank " << g << "'s stream";
  std::vector<absl::StatusOr<BatchGradients>> want(kD, absl::UnknownError("")), got(kW, absl::UnknownError(""));
  on(kD, [&](int r) { want[static_cast<size_t>(r)] = ref[static_cast<size_t>(r)]->Gradients(batches[static_cast<size_t>(r)]); });
  on(kW, [&](int r) { got[static_cast<size_t>(r)] = ranks[static_cast<size_t>(r)]->Gradients(batches[static_cast<size_t>(r / kP)]); });
  ASSERT_TRUE(want[0].ok()) << want[0].status();
  for (int r = 0; r < kW; ++r) {
    ASSERT_TRUE(got[static_cast<size_t>(r)].ok()) << got[static_cast<size_t>(r)].status();
    ExpectGradientsClose(*got[static_cast<size_t>(r)], *want[0], 1e-5, "rank " + std::to_string(r));
  }
  std::vector<StepResult> want_step(kD), got_step(kW);
  on(kD, [&](int r) { want_step[static_cast<size_t>(r)] = ref[static_cast<size_t>(r)]->Step(batches[static_cast<size_t>(r)]); });
  on(kW, [&](int r) { got_step[static_cast<size_t>(r)] = ranks[static_cast<size_t>(r)]->Step(batches[static_cast<size_t>(r / kP)]); });
  for (int r = 0; r < kW; ++r) {
    const StepResult& g = got_step[static_cast<size_t>(r)];
    ASSERT_TRUE(g.status.ok()) << g.status;
    EXPECT_NEAR(g.loss, want_step[0].loss, 1e-5 * want_step[0].loss) << "rank " << r;
    EXPECT_NEAR(g.grad_norm, want_step[0].grad_norm, 1e-5 * want_step[0].grad_norm) << "rank " << r;
    EXPECT_EQ(g.tokens, want_step[0].tokens) << "rank " << r << ": every rank counts the global positions";
  }
  for (int r = 1; r < kW; ++r) ExpectWeightsEqual(*ranks[0], *ranks[static_cast<size_t>(r)], "rank " + std::to_string(r));
}

TEST(ContextParallelTest, BadLayoutsAreRefusedNamingBothNumbers) {
  auto group = InProcessGroup::Create(3, absl::Seconds(1));
  auto comm = group->Rank(0);
  TrainerOptions o = Tiny();
  o.context_parallel.group = comm.get();
  EXPECT_EQ(Trainer::Create(o).status().message(), "context_parallel (3) must divide num_attention_heads (4)");
  auto two = InProcessGroup::Create(2, absl::Seconds(1));
  auto c2 = two->Rank(0);
  o.context_parallel.group = c2.get();
  o.data.seq_len = 63;
  EXPECT_EQ(Trainer::Create(o).status().message(), "context_parallel (2) must divide data.seq_len (63)");
}

TrainerOptions HybridTiny() {
  TrainerOptions o = Tiny();
  o.model = "hybrid-tiny";  // KKKD: 3 KDA layers (4 heads) and a DSA layer (4 query, 2 KV heads)
  return o;
}

// The hybrid family on the shards (model/hybrid.h: the KDA and DSA layers' heads split over the
// ranks, the sequence's tiles broadcast by the rank that holds them): the step equals one
// rank's, with the indexer's KL training, recompute (its no-grad forward runs the collectives
// too), offload, nested checkpoints and kept selections.
TEST(ContextParallelTest, HybridLayersOnShardsEqualOneRank) {
  torch::set_num_threads(1);
  ExpectEqualsOneRank(2, HybridTiny(), /*packed=*/false, "hybrid");
  TrainerOptions o = HybridTiny();
  o.memory.recompute = planner::Recompute::kLayer;
  o.memory.offload = true;
  o.memory.device_resident = 1;
  o.memory.keep_selection = true;
  o.memory.mlp_tile = 5;
  o.memory.loss_tile = 7;
  ExpectEqualsOneRank(2, o, /*packed=*/false, "hybrid recompute offload keep_selection tiles");
  o = HybridTiny();
  o.memory.recompute = planner::Recompute::kEveryK;
  o.memory.every_k = 2;
  ExpectEqualsOneRank(2, o, /*packed=*/false, "hybrid every_k 2");
  // LoRA: the adapters' rows split with the heads (their B's rows; A whole).
  o = HybridTiny();
  o.memory.recompute = planner::Recompute::kLayer;
  o.lora.rank = 4;
  ExpectEqualsOneRank(2, o, /*packed=*/false, "hybrid LoRA", /*warm=*/true);
}

// What the hybrid layers cannot split is refused by name before any rank starts.
TEST(ContextParallelTest, HybridLayoutsTheLayersCannotSplitAreRefused) {
  auto four = InProcessGroup::Create(4, absl::Seconds(1));
  auto c4 = four->Rank(0);
  TrainerOptions o = HybridTiny();
  o.context_parallel.group = c4.get();
  EXPECT_EQ(Trainer::Create(o).status().message(), "parallel.context_parallel (4) must divide the DSA layers' KV heads (2)");
  auto two = InProcessGroup::Create(2, absl::Seconds(1));
  auto c2 = two->Rank(0);
  o.context_parallel.group = c2.get();
  o.data.seq_len = 60;
  EXPECT_EQ(Trainer::Create(o).status().message(),
            "data.seq_len (60) must be a multiple of 4 x parallel.context_parallel (2) for the DSA layers: each rank's "
            "positions are whole pools of 4 counted from the first token");
  o.data.seq_len = 64;
  o.data.format = "jsonl";
  EXPECT_THAT(std::string(Trainer::Create(o).status().message()),
              testing::HasSubstr("with data.format jsonl (packed documents) is not implemented for the hybrid family"));
  o.data.format = "kjv";
  o.context_parallel.head_chunk = 2;
  EXPECT_THAT(std::string(Trainer::Create(o).status().message()),
              testing::HasSubstr("context_parallel.head_chunk (2) is not implemented for the hybrid family"));
  o.context_parallel.head_chunk = 0;
  o.memory.head_groups = 2;
  EXPECT_THAT(std::string(Trainer::Create(o).status().message()),
              testing::HasSubstr("memory.head_groups (2) is not implemented for the hybrid family with context "
                                 "parallelism (2 ranks)"));
}

// A KDA and a DSA layer of hybrid-tiny's widths (4 KV heads, so that 4 ranks split them too),
// fp64, in tiles smaller than a rank's shard (16 tokens: 3 per shard at P = 2; 16 + 8 at P = 4),
// 2 rows: the ranks' outputs are the whole sequence's rows, their input gradients its input
// gradient, their weight gradients sum to its, and their KL shares to its KL (and the indexer's
// gradients through it). The KDA layer's gate and beta are fp32 by design: its bar is fp32's.
TEST(ContextParallelTest, HybridLayersSplitByHeadsEqualTheWholeSequence) {
  torch::set_num_threads(1);
  model::ModelConfig c = model::NamedShape("hybrid-tiny").value();
  c.num_key_value_heads = 4;
  const int64_t B = 2, S = 96, tile = 16;
  const double kl_weight = 0.7;
  torch::manual_seed(31);
  const torch::Tensor x = torch::randn({B, S, c.hidden_size}, torch::kFloat64);
  using Grads = std::map<std::string, torch::Tensor>;
  // Runs `mixer` (Heads then the objective's backward) on rows [first, first + n) of x; gy is
  // the whole sequence's output gradient.
  auto run = [&](torch::nn::Module& mod, const std::function<torch::Tensor(const torch::Tensor&, torch::Tensor*)>& heads,
                 const torch::Tensor& gy, int64_t first, int64_t n) {
    mod.zero_grad();
    torch::Tensor xi = x.narrow(1, first, n).clone().requires_grad_(true);
    torch::Tensor kl;
    torch::Tensor y = heads(xi, &kl);
    torch::Tensor objective = (y * gy.narrow(1, first, n)).sum();
    if (kl.defined()) objective = objective + kl_weight * kl;
    objective.backward();
    Grads out = {{"y", y.detach()}, {"dx", xi.grad()}};
    if (kl.defined()) out["kl"] = kl.detach().to(torch::kFloat64).view({1});
    for (auto& p : mod.named_parameters())
      if (p.value().grad().defined()) out[p.key()] = p.value().grad().clone();
    return out;
  };
  for (const char* kind : {"kda", "dsa"}) {
    const bool kda = std::string(kind) == "kda";
    // One module per rank plus the reference, all with the reference's weights.
    auto make = [&]() -> std::shared_ptr<torch::nn::Module> {
      if (kda) {
        model::KdaAttention m(c);
        m->InitSpecial(std::nullopt);
        m->to(torch::kFloat64);
        m->set_tile(tile);
        return m.ptr();
      }
      model::DsaAttention m(c);
      m->to(torch::kFloat64);
      m->set_tile(tile);
      return m.ptr();
    };
    auto heads_of = [&](const std::shared_ptr<torch::nn::Module>& mod, const model::SequenceGroup* group) {
      return [mod, group, kda](const torch::Tensor& xi, torch::Tensor* kl) {
        if (kda) return std::dynamic_pointer_cast<model::KdaAttentionImpl>(mod)->Heads(xi, {}, group);
        return std::dynamic_pointer_cast<model::DsaAttentionImpl>(mod)->Heads(xi, {}, nullptr, kl, group);
      };
    };
    std::shared_ptr<torch::nn::Module> ref = make();
    {
      torch::NoGradGuard no_grad;
      for (auto& p : ref->parameters())
        p.copy_(torch::randn_like(p) * (p.dim() >= 2 ? 0.3 : 0.1) + (p.dim() == 1 && !kda ? 1.0 : 0.0));
    }
    const int64_t width = c.num_attention_heads * c.HeadDim();
    const torch::Tensor gy = torch::randn({B, S, width}, torch::kFloat64);
    const Grads want = run(*ref, heads_of(ref, nullptr), gy, 0, S);
    ASSERT_GT(want.at("dx").abs().max().item<double>(), 0.0) << kind;
    if (!kda) {
      ASSERT_TRUE(want.count("kl") && want.count("indexer.wq.weight")) << "the KL trains";
    }
    for (int P : {2, 4}) {
      const std::string at = std::string(kind) + " P " + std::to_string(P);
      auto group = InProcessGroup::Create(P, absl::Seconds(120));
      std::vector<std::unique_ptr<Communicator>> comms;
      std::vector<std::unique_ptr<CommunicatorSequenceGroup>> groups;
      std::vector<std::shared_ptr<torch::nn::Module>> mods;
      for (int r = 0; r < P; ++r) {
        comms.push_back(group->Rank(r));
        groups.push_back(std::make_unique<CommunicatorSequenceGroup>(*comms.back()));
        mods.push_back(make());
        torch::NoGradGuard no_grad;
        auto src = ref->named_parameters();
        for (auto& p : mods.back()->named_parameters()) p.value().copy_(src[p.key()]);
      }
      const int64_t L = S / P;
      std::vector<Grads> got(static_cast<size_t>(P));
      std::vector<torch::Tensor> no_grad_out(static_cast<size_t>(P));
      std::vector<std::thread> threads;
      for (int r = 0; r < P; ++r)
        threads.emplace_back([&, r] {
          const auto u = static_cast<size_t>(r);
          got[u] = run(*mods[u], heads_of(mods[u], groups[u].get()), gy, r * L, L);
          torch::NoGradGuard no_grad;
          no_grad_out[u] = heads_of(mods[u], groups[u].get())(x.narrow(1, r * L, L), nullptr);
        });
      for (auto& t : threads) t.join();
      for (const auto& [name, w] : want) {
        torch::Tensor sum;
        if (name == "y" || name == "dx") {
          std::vector<torch::Tensor> parts;
          for (const Grads& g : got) parts.push_back(g.at(name));
          sum = torch::cat(parts, 1);
        } else {
          for (const Grads& g : got) {
            ASSERT_TRUE(g.count(name)) << at << ": no " << name;
            sum = sum.defined() ? sum + g.at(name) : g.at(name);
          }
        }
        const bool fp32 = kda || name == "kl" || name.find("indexer.") == 0;
        const double bar = (fp32 ? 1e-5 : 1e-10) * (1.0 + w.abs().max().item<double>());
        EXPECT_LT((sum - w).abs().max().item<double>(), bar) << at << ": " << name;
      }
      std::vector<torch::Tensor> rows(no_grad_out.begin(), no_grad_out.end());
      EXPECT_LT((torch::cat(rows, 1) - want.at("y")).abs().max().item<double>(), kda ? 1e-5 : 1e-10)
          << at << ": without grad";
    }
  }
}

void ExpectLogprobsClose(const std::vector<std::vector<float>>& got, const std::vector<std::vector<float>>& want,
                         const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(got[i].size(), want[i].size()) << what << " datum " << i;
    for (size_t k = 0; k < want[i].size(); ++k)
      ASSERT_NEAR(got[i][k], want[i][k], 1e-5 * std::abs(want[i][k])) << what << " datum " << i << " token " << k;
  }
}

// An RL session's calls on P ranks (every rank the whole batch, its positions of each padded
// row) equal one rank's: Forward's logprobs, two accumulated ForwardBackward calls (loss,
// logprobs, mismatch, clipped tokens) and the OptimStep's gradient norm, ranks bitwise alike.
void ExpectRlEqualsOneRank(int P, TrainerOptions options, const std::string& what) {
  options.rl_group_tokens = 80;  // [37, 5] and [64]; [64] and [29, 6]
  TrainerOptions one = options;
  auto single = Trainer::Create(one);
  ASSERT_TRUE(single.ok()) << single.status();
  Group g = MakeGroup(P, options);
  for (const auto& t : g.ranks) ASSERT_TRUE(t);
  CopyWeights(*g.ranks[0], **single);
  const std::string at = what + " P " + std::to_string(P);
  // Lengths P does not divide, one datum shorter than a rank's first position (it lies wholly
  // on rank 0), two padded groups per batch.
  const std::vector<Datum> first = rl_testing::RandomBatch(**single, 1, {37, 5, 64});
  const std::vector<Datum> second = rl_testing::RandomBatch(**single, 2, {64, 29, 6});

  std::vector<absl::StatusOr<std::vector<std::vector<float>>>> fwd(static_cast<size_t>(P), absl::UnknownError(""));
  g.Run([&](int r) { fwd[static_cast<size_t>(r)] = g.ranks[static_cast<size_t>(r)]->Forward(first); });
  absl::StatusOr<std::vector<std::vector<float>>> want_fwd = (*single)->Forward(first);
  ASSERT_TRUE(want_fwd.ok()) << want_fwd.status();
  for (int r = 0; r < P; ++r) {
    ASSERT_TRUE(fwd[static_cast<size_t>(r)].ok()) << at << ": " << fwd[static_cast<size_t>(r)].status();
    ExpectLogprobsClose(*fwd[static_cast<size_t>(r)], *want_fwd, at + " forward rank " + std::to_string(r));
  }

  LossSpec ppo;
  ppo.kind = LossKind::kPpo;
  ppo.clip_low = 0.2;
  ppo.clip_high = 0.2;
  LossSpec ce;
  ce.kind = LossKind::kCrossEntropy;
  for (const auto& [batch, loss] : {std::pair{&first, ppo}, std::pair{&second, ce}}) {
    std::vector<absl::StatusOr<ForwardBackwardResult>> got(static_cast<size_t>(P), absl::UnknownError(""));
    g.Run([&](int r) { got[static_cast<size_t>(r)] = g.ranks[static_cast<size_t>(r)]->ForwardBackward(*batch, loss); });
    absl::StatusOr<ForwardBackwardResult> want = (*single)->ForwardBackward(*batch, loss);
    ASSERT_TRUE(want.ok()) << want.status();
    for (int r = 0; r < P; ++r) {
      const std::string rank = at + " forward_backward rank " + std::to_string(r);
      ASSERT_TRUE(got[static_cast<size_t>(r)].ok()) << rank << ": " << got[static_cast<size_t>(r)].status();
      const ForwardBackwardResult& res = *got[static_cast<size_t>(r)];
      EXPECT_NEAR(res.loss, want->loss, 1e-5 * std::abs(want->loss)) << rank;
      EXPECT_EQ(res.loss, got[0]->loss) << rank << ": the ranks agree bitwise";
      EXPECT_DOUBLE_EQ(res.weight_sum, want->weight_sum) << rank;
      EXPECT_EQ(res.tokens, want->tokens) << rank;
      EXPECT_EQ(res.clipped_tokens, want->clipped_tokens) << rank;
      EXPECT_EQ(res.mismatch.tokens, want->mismatch.tokens) << rank;
      EXPECT_NEAR(res.mismatch.mean_abs(), want->mismatch.mean_abs(), 1e-5 * want->mismatch.mean_abs()) << rank;
      ExpectLogprobsClose(res.logprobs, want->logprobs, rank);
    }
  }
  AdamWOptions adam = options.optimizer;
  std::vector<absl::StatusOr<OptimStepResult>> steps(static_cast<size_t>(P), absl::UnknownError(""));
  g.Run([&](int r) { steps[static_cast<size_t>(r)] = g.ranks[static_cast<size_t>(r)]->OptimStep(adam); });
  absl::StatusOr<OptimStepResult> want_step = (*single)->OptimStep(adam);
  ASSERT_TRUE(want_step.ok()) << want_step.status();
  for (int r = 0; r < P; ++r) {
    ASSERT_TRUE(steps[static_cast<size_t>(r)].ok()) << at << ": " << steps[static_cast<size_t>(r)].status();
    EXPECT_NEAR(steps[static_cast<size_t>(r)]->grad_norm, want_step->grad_norm, 1e-5 * want_step->grad_norm) << at;
    EXPECT_EQ(steps[static_cast<size_t>(r)]->step, 1) << at;
  }
  // The same update on every rank (AdamW against one rank's: see ExpectEqualsOneRank).
  for (int r = 1; r < P; ++r) ExpectWeightsEqual(*g.ranks[0], *g.ranks[static_cast<size_t>(r)], at + " ranks");
  // A second optim_step without a forward_backward is refused on every rank alike.
  g.Run([&](int r) { steps[static_cast<size_t>(r)] = g.ranks[static_cast<size_t>(r)]->OptimStep(adam); });
  for (int r = 0; r < P; ++r)
    EXPECT_EQ(steps[static_cast<size_t>(r)].status().code(), absl::StatusCode::kFailedPrecondition) << at;
}

TEST(ContextParallelTest, RlCallsEqualOneRank) {
  torch::set_num_threads(1);
  TrainerOptions o = Tiny();
  ExpectRlEqualsOneRank(2, o, "plain");
  // The hybrid family: right-padded rows (to whole pools of 4 on each rank), the layers' heads
  // split over the ranks.
  ExpectRlEqualsOneRank(2, HybridTiny(), "hybrid");
  ExpectRlEqualsOneRank(4, o, "plain");
  // The memory stack on the shards of padded rows: recompute, offload, tiles that divide
  // nothing, kept attention.
  o.memory.recompute = planner::Recompute::kLayer;
  o.memory.offload = true;
  o.memory.mlp_tile = 6;
  o.memory.loss_tile = 9;
  o.memory.keep_attention = true;
  ExpectRlEqualsOneRank(2, o, "everything");
}

// An invalid datum is refused on every rank, naming it, before anything runs.
TEST(ContextParallelTest, RlBadBatchIsRefusedOnEveryRank) {
  auto single = Trainer::Create(Tiny());
  ASSERT_TRUE(single.ok()) << single.status();
  std::vector<Datum> batch = rl_testing::RandomBatch(**single, 3, {9, 12});
  Group g = MakeGroup(2, Tiny());
  for (const auto& t : g.ranks) ASSERT_TRUE(t);
  batch[1].target_tokens[2] = 1 << 20;  // past the vocabulary
  std::vector<absl::Status> got(2);
  g.Run([&](int r) { got[static_cast<size_t>(r)] = g.ranks[static_cast<size_t>(r)]->ForwardBackward(batch, LossSpec{}).status(); });
  for (const absl::Status& s : got) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("batch[1].target_tokens[2]"), std::string::npos) << s;
  }
}

// RL data parallel over context-parallel groups: 2 groups of 2 thread-ranks, each group one
// data-parallel slice of the batch, give the logprobs, loss and grad norm of 2 data-parallel
// ranks with the same slices (1e-5); the four ranks end bitwise alike.
TEST(ContextParallelTest, RlDataParallelOverContextGroupsEqualsDataParallel) {
  torch::set_num_threads(1);
  TrainerOptions o = Tiny();
  o.rl_group_tokens = 80;
  constexpr int kP = DpOverCp::kP, kD = DpOverCp::kD, kW = DpOverCp::kW;
  DpOverCp layout = MakeDpOverCp(o);
  for (const auto& t : layout.ref) ASSERT_TRUE(t);
  for (const auto& t : layout.ranks) ASSERT_TRUE(t);
  std::vector<std::unique_ptr<Trainer>>& ref = layout.ref;
  std::vector<std::unique_ptr<Trainer>>& ranks = layout.ranks;
  const auto& on = DpOverCp::On;
  auto single = Trainer::Create(o);
  ASSERT_TRUE(single.ok()) << single.status();
  CopyWeights(*ranks[0], **single);
  // The whole batch's slices as the controller cuts them, datum offsets and the whole W.
  const std::vector<Datum> whole = rl_testing::RandomBatch(**single, 4, {37, 5, 64, 29});
  const std::vector<std::vector<Datum>> slices = {{whole[0], whole[1]}, {whole[2], whole[3]}};
  double W = 0;
  for (const Datum& d : whole)
    for (float w : d.weights) W += w;
  auto shard_of = [&](int g) {
    RlShard s;
    s.weight_sum = W;
    s.datum_offset = g == 0 ? 0 : 2;
    return s;
  };
  LossSpec ppo;
  ppo.kind = LossKind::kPpo;
  std::vector<absl::StatusOr<ForwardBackwardResult>> want(kD, absl::UnknownError("")), got(kW, absl::UnknownError(""));
  on(kD, [&](int r) {
    want[static_cast<size_t>(r)] = ref[static_cast<size_t>(r)]->ForwardBackward(slices[static_cast<size_t>(r)], ppo, shard_of(r));
  });
  on(kW, [&](int r) {
    got[static_cast<size_t>(r)] =
        ranks[static_cast<size_t>(r)]->ForwardBackward(slices[static_cast<size_t>(r / kP)], ppo, shard_of(r / kP));
  });
  for (int r = 0; r < kW; ++r) {
    ASSERT_TRUE(got[static_cast<size_t>(r)].ok()) << got[static_cast<size_t>(r)].status();
    const ForwardBackwardResult& w = *want[static_cast<size_t>(r / kP)];
    EXPECT_NEAR(got[static_cast<size_t>(r)]->loss, w.loss, 1e-5 * std::abs(w.loss)) << "rank " << r;
    EXPECT_EQ(got[static_cast<size_t>(r)]->clipped_tokens, w.clipped_tokens) << "rank " << r;
    ExpectLogprobsClose(got[static_cast<size_t>(r)]->logprobs, w.logprobs, "rank " + std::to_string(r));
  }
  AdamWOptions adam = o.optimizer;
  std::vector<absl::StatusOr<OptimStepResult>> want_step(kD, absl::UnknownError("")), got_step(kW, absl::UnknownError(""));
  on(kD, [&](int r) { want_step[static_cast<size_t>(r)] = ref[static_cast<size_t>(r)]->OptimStep(adam); });
  on(kW, [&](int r) { got_step[static_cast<size_t>(r)] = ranks[static_cast<size_t>(r)]->OptimStep(adam); });
  ASSERT_TRUE(want_step[0].ok()) << want_step[0].status();
  for (int r = 0; r < kW; ++r) {
    ASSERT_TRUE(got_step[static_cast<size_t>(r)].ok()) << got_step[static_cast<size_t>(r)].status();
    EXPECT_NEAR(got_step[static_cast<size_t>(r)]->grad_norm, want_step[0]->grad_norm, 1e-5 * want_step[0]->grad_norm)
        << "rank " << r;
  }
  for (int r = 1; r < kW; ++r) ExpectWeightsEqual(*ranks[0], *ranks[static_cast<size_t>(r)], "rank " + std::to_string(r));
  // A bad datum in group 1's slice is refused on every rank; group 0's ranks hear of it.
  std::vector<Datum> bad = slices[1];
  bad[1].tokens[3] = 1 << 20;
  std::vector<absl::Status> refused(kW);
  on(kW, [&](int r) {
    refused[static_cast<size_t>(r)] =
        ranks[static_cast<size_t>(r)]->ForwardBackward(r < kP ? slices[0] : bad, ppo, shard_of(r / kP)).status();
  });
  for (int r = 0; r < kW; ++r) {
    EXPECT_EQ(refused[static_cast<size_t>(r)].code(), absl::StatusCode::kInvalidArgument) << refused[static_cast<size_t>(r)];
    if (r >= kP) {
      EXPECT_NE(refused[static_cast<size_t>(r)].message().find("batch[3].tokens[3]"), std::string::npos)
          << refused[static_cast<size_t>(r)];
    }
  }
}

}  // namespace
}  // namespace odyssey::engine
