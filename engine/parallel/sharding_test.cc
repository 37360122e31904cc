// Parameter sharding (ZeRO-3) through the Trainer on thread-ranks (fp32, CPU, the tiny model):
// each rank keeps ceil(N / P) elements of every parameter and its AdamW state, and
//   - the gradients of a sharded step equal one rank's (P = 2 and 3: 3 pads the shards), with
//     layer recompute (gathered per layer, again for the recompute, reduce-scattered per layer)
//     and without (whole until the backward ends);
//   - sharded AdamW equals unsharded AdamW after 3 steps (weights, clipped at the global norm);
//   - a checkpoint saved at P = 4 is the one-rank format, and loads at P = 2, at P = 1 and
//     unsharded with the same losses and per-token logprobs, and trains on alike;
//   - sharded over a context-parallel group of 2 equals one rank.
#include "engine/parallel/sharding.h"

#include <unistd.h>

#include <filesystem>
#include <functional>
#include <thread>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "engine/parallel/communicator.h"
#include "engine/parallel/parallel_testing.h"
#include "engine/trainer.h"
#include "model/safetensors.h"

namespace odyssey::engine {
namespace {

using parallel_testing::ExpectGradientsClose;

TrainerOptions Tiny() {
  TrainerOptions o;
  o.model = "tiny";  // 4 query heads, 2 KV heads, 4 layers, hidden 128
  o.device = "cpu";
  o.dtype = "float32";
  o.attention = "math";
  o.steps = 10;
  o.optimizer.lr = 1e-3;
  o.optimizer.weight_decay = 0.1;
  o.schedule.warmup_steps = 1;
  o.grad_clip = 0.5;  // low enough to clip: the clip must see the global norm
  o.data.format = "kjv";
  o.data.seq_len = 32;
  o.data.batch_size = 2;
  o.seed = 5;
  return o;
}

// P thread-ranks, each with its trainer; sharded over the communicator (data parallel on the
// same batch: the ranks' gradients sum to one rank's) or over a context-parallel group.
struct Ranks {
  std::vector<std::unique_ptr<Communicator>> comms;
  std::vector<std::unique_ptr<Trainer>> trainers;

  void Run(const std::function<void(int)>& fn) {
    std::vector<std::thread> threads;
    for (int r = 0; r < static_cast<int>(trainers.size()); ++r) threads.emplace_back(fn, r);
    for (auto& t : threads) t.join();
  }
  Trainer& at(int r) { return *trainers[static_cast<size_t>(r)]; }
};

Ranks MakeRanks(int P, TrainerOptions o, bool context_parallel) {
  Ranks g;
  auto group = InProcessGroup::Create(P, absl::Seconds(120));
  for (int r = 0; r < P; ++r) g.comms.push_back(group->Rank(r));
  g.trainers.resize(static_cast<size_t>(P));
  std::vector<absl::Status> created(static_cast<size_t>(P));
  o.shard_params = true;
  g.Run([&](int r) {
    TrainerOptions mine = o;
    Communicator* c = g.comms[static_cast<size_t>(r)].get();
    if (context_parallel) {
      mine.context_parallel.group = c;
    } else {
      mine.communicator = c;
    }
    auto t = Trainer::Create(mine);
    created[static_cast<size_t>(r)] = t.status();
    if (t.ok()) g.trainers[static_cast<size_t>(r)] = *std::move(t);
  });
  for (const absl::Status& s : created) EXPECT_TRUE(s.ok()) << s;
  return g;
}

// Every rank saves (rank 0 writes `dir`); returns the weights read back.
std::map<std::string, torch::Tensor> SaveAndRead(Ranks& g, const std::string& dir) {
  std::vector<absl::Status> saved(g.trainers.size());
  g.Run([&](int r) { saved[static_cast<size_t>(r)] = g.at(r).SaveCheckpoint(dir); });
  for (const absl::Status& s : saved) EXPECT_TRUE(s.ok()) << s;
  std::map<std::string, torch::Tensor> out;
  auto file = model::SafetensorsFile::Open((std::filesystem::path(dir) / "model.safetensors").string());
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return out;
  for (const auto& [name, info] : (*file)->tensors()) out[name] = *(*file)->Read(name);
  return out;
}

void ExpectWeightsClose(const std::map<std::string, torch::Tensor>& got, Trainer& want, double rtol,
                        const std::string& what) {
  auto params = want.model()->named_parameters();
  ASSERT_EQ(got.size(), params.size()) << what;
  for (auto& p : params) {
    ASSERT_TRUE(got.count(p.key())) << what << ": " << p.key();
    const double scale = p.value().abs().max().item<double>();
    EXPECT_LE((got.at(p.key()) - p.value()).abs().max().item<double>(), rtol * scale) << what << ": " << p.key();
  }
}

std::string TempDir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() / ("odyssey-sharding-" + name + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  return dir.string();
}

TEST(ShardingTest, ShardsAreOnePthOfEachParameter) {
  auto group = InProcessGroup::Create(3);
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < 3; ++r) comms.push_back(group->Rank(r));
  const torch::Tensor w = torch::arange(10, torch::kFloat32).view({2, 5});  // 10 elements: 4, 4, 2 + 2 padding
  const torch::Tensor b = torch::arange(4, torch::kFloat32) + 100;          // 4: 2, 2, 0 + 2 padding
  std::vector<torch::Tensor> shards_w(3), shards_b(3), whole(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r)
    threads.emplace_back([&, r] {
      torch::Tensor pw = w.clone().requires_grad_(true), pb = b.clone().requires_grad_(true);
      auto s = ShardedParameters::Create(*comms[static_cast<size_t>(r)], {{"w", pw}, {"b", pb}}, {{0, 1}});
      ASSERT_TRUE(s.ok()) << s.status();
      EXPECT_EQ(pw.numel(), 0);  // freed until gathered
      shards_w[static_cast<size_t>(r)] = (*s)->Shards()[0].detach().clone();
      shards_b[static_cast<size_t>(r)] = (*s)->Shards()[1].detach().clone();
      (*s)->Gather(0);
      whole[static_cast<size_t>(r)] = pw.detach().clone();
      pw.mutable_grad() = torch::ones_like(pw) * (r + 1);  // summed over ranks: 6
      (*s)->ReduceGradients(0);
      EXPECT_EQ(pw.numel(), 0);
      EXPECT_TRUE(torch::equal((*s)->Shards()[0].grad(), r < 2 ? torch::full({1, 4}, 6.0f)
                                                                 : torch::tensor({{6.0f, 6.0f, 0.0f, 0.0f}})));
      EXPECT_FALSE(pb.grad().defined());
      EXPECT_TRUE(torch::equal((*s)->Shards()[1].grad(), torch::zeros({2})));  // no gradient: zeros
    });
  for (auto& t : threads) t.join();
  EXPECT_TRUE(torch::equal(shards_w[0], torch::tensor({{0.0f, 1.0f, 2.0f, 3.0f}})));
  EXPECT_TRUE(torch::equal(shards_w[2], torch::tensor({{8.0f, 9.0f, 0.0f, 0.0f}})));
  EXPECT_TRUE(torch::equal(shards_b[1], torch::tensor({102.0f, 103.0f})));
  EXPECT_TRUE(torch::equal(shards_b[2], torch::zeros({2})));
  for (const torch::Tensor& t : whole) EXPECT_TRUE(torch::equal(t, w));
}

// The gradients a sharded step applies (gathered whole) are one rank's; P = 3 pads every shard.
TEST(ShardingTest, ShardedGradientsEqualOneRank) {
  for (bool recompute : {true, false}) {
    for (int P : {2, 3}) {
      const std::string what = std::string(recompute ? "recompute layer" : "no recompute") + " P " + std::to_string(P);
      TrainerOptions o = Tiny();
      if (recompute) o.memory.recompute = planner::Recompute::kLayer;
      auto single = Trainer::Create(o);
      ASSERT_TRUE(single.ok()) << single.status();
      Ranks g = MakeRanks(P, o, /*context_parallel=*/false);
      for (const auto& t : g.trainers) ASSERT_TRUE(t);
      const Batch batch = (*single)->data().Next();
      std::vector<absl::StatusOr<BatchGradients>> grads(static_cast<size_t>(P), absl::UnknownError("not run"));
      g.Run([&](int r) { grads[static_cast<size_t>(r)] = g.at(r).Gradients(batch); });
      absl::StatusOr<BatchGradients> want = (*single)->Gradients(batch);
      ASSERT_TRUE(want.ok()) << want.status();
      for (int r = 0; r < P; ++r) {
        ASSERT_TRUE(grads[static_cast<size_t>(r)].ok()) << what << ": " << grads[static_cast<size_t>(r)].status();
        ExpectGradientsClose(*grads[static_cast<size_t>(r)], *want, 1e-5, what + " rank " + std::to_string(r));
      }
      // Outside a forward a rank holds no whole parameter.
      for (auto& p : g.at(0).model()->named_parameters()) EXPECT_EQ(p.value().numel(), 0) << what << ": " << p.key();
    }
  }
}

// Three sharded AdamW steps (clipped at the global norm) give the unsharded weights; also with
// the optimizer's state and update on the host, at its laziest (deferred_cpu: a shard read
// before its update is waited for would be stale).
void ExpectShardedAdamWEqualsUnsharded(bool host) {
  TrainerOptions o = Tiny();
  o.memory.recompute = planner::Recompute::kLayer;
  auto single = Trainer::Create(o);
  ASSERT_TRUE(single.ok()) << single.status();
  if (host) {
    o.memory.optimizer_on_host = true;
    o.host_optimizer.deferred_cpu = true;
  }
  Ranks g = MakeRanks(2, o, /*context_parallel=*/false);
  for (const auto& t : g.trainers) ASSERT_TRUE(t);
  for (int step = 0; step < 3; ++step) {
    const Batch batch = (*single)->data().Next();
    std::vector<StepResult> results(2);
    g.Run([&](int r) { results[static_cast<size_t>(r)] = g.at(r).Step(batch); });
    const StepResult want = (*single)->Step(batch);
    for (const StepResult& got : results) {
      ASSERT_TRUE(got.status.ok()) << got.status;
      EXPECT_NEAR(got.loss, want.loss, 1e-5 * want.loss) << "step " << step;
      EXPECT_NEAR(got.grad_norm, want.grad_norm, 1e-5 * want.grad_norm) << "step " << step;
      if (step == 0) {
        EXPECT_GT(want.grad_norm, o.grad_clip) << "the clip must act";
      }
    }
  }
  const std::string dir = TempDir("adamw");
  ExpectWeightsClose(SaveAndRead(g, dir), **single, 1e-5, "after 3 steps");
  std::filesystem::remove_all(dir);
}

TEST(ShardingTest, ShardedAdamWEqualsUnshardedAfterThreeSteps) {
  for (bool host : {false, true}) {
    SCOPED_TRACE(host ? "optimizer on the host" : "optimizer on the device");
    ExpectShardedAdamWEqualsUnsharded(host);
  }
}

// Saved at P = 4 (gathered to the one-rank format), loaded at P = 2, P = 1 and unsharded: the
// same losses and logprobs, and the next step (resharded AdamW state) the same.
TEST(ShardingTest, SavedAtFourLoadsAtTwoAndOne) {
  TrainerOptions o = Tiny();
  o.memory.recompute = planner::Recompute::kLayer;
  Ranks four = MakeRanks(4, o, /*context_parallel=*/false);
  for (const auto& t : four.trainers) ASSERT_TRUE(t);
  auto source = Trainer::Create(Tiny());  // only its data
  ASSERT_TRUE(source.ok());
  for (int step = 0; step < 2; ++step) {
    const Batch batch = (*source)->data().Next();
    four.Run([&](int r) { EXPECT_TRUE(four.at(r).Step(batch).status.ok()); });
  }
  const std::string dir = TempDir("reshard");
  const std::map<std::string, torch::Tensor> saved = SaveAndRead(four, dir);
  ASSERT_FALSE(saved.empty());
  const Batch probe = (*source)->data().Next();
  std::vector<double> loss4(4);
  four.Run([&](int r) { loss4[static_cast<size_t>(r)] = four.at(r).EvalLoss(probe); });
  std::vector<StepResult> next4(4);
  four.Run([&](int r) { next4[static_cast<size_t>(r)] = four.at(r).Step(probe); });

  // Unsharded: the same weights as the file, and per-token logprobs as the sharded ranks see them.
  TrainerOptions plain = Tiny();
  plain.memory.recompute = planner::Recompute::kLayer;
  auto unsharded = Trainer::Create(plain);
  ASSERT_TRUE(unsharded.ok());
  ASSERT_TRUE((*unsharded)->LoadCheckpoint(dir).ok());
  EXPECT_EQ((*unsharded)->step(), 2);
  EXPECT_NEAR((*unsharded)->EvalLoss(probe), loss4[0], 1e-6 * loss4[0]);
  const StepResult next_plain = (*unsharded)->Step(probe);
  EXPECT_NEAR(next_plain.loss, next4[0].loss, 1e-6 * next4[0].loss);
  EXPECT_NEAR(next_plain.grad_norm, next4[0].grad_norm, 1e-5 * next4[0].grad_norm);

  for (int P : {2, 1}) {
    Ranks g = MakeRanks(P, o, /*context_parallel=*/false);
    for (const auto& t : g.trainers) ASSERT_TRUE(t);
    std::vector<absl::Status> loaded(static_cast<size_t>(P));
    g.Run([&](int r) { loaded[static_cast<size_t>(r)] = g.at(r).LoadCheckpoint(dir); });
    for (const absl::Status& s : loaded) ASSERT_TRUE(s.ok()) << s;
    std::vector<double> loss(static_cast<size_t>(P));
    g.Run([&](int r) { loss[static_cast<size_t>(r)] = g.at(r).EvalLoss(probe); });
    for (double l : loss) EXPECT_NEAR(l, loss4[0], 1e-6 * loss4[0]) << "P " << P;
    std::vector<StepResult> next(static_cast<size_t>(P));
    g.Run([&](int r) { next[static_cast<size_t>(r)] = g.at(r).Step(probe); });
    for (const StepResult& n : next) {
      ASSERT_TRUE(n.status.ok()) << n.status;
      EXPECT_EQ(n.step, 3);
      EXPECT_NEAR(n.loss, next4[0].loss, 1e-6 * next4[0].loss) << "P " << P;
      EXPECT_NEAR(n.grad_norm, next4[0].grad_norm, 1e-5 * next4[0].grad_norm) << "P " << P;
    }
    // After the step: the weights of the unsharded run's step (the moments were resharded).
    const std::string again = TempDir("reshard-" + std::to_string(P));
    ExpectWeightsClose(SaveAndRead(g, again), **unsharded, 1e-5, "P " + std::to_string(P) + " after a step");
    std::filesystem::remove_all(again);
  }
  std::filesystem::remove_all(dir);
}

// The ranks' gradients of one batch against `single`'s (each within rtol); returns the ranks'
// (empty after a failure, which is reported). The batch is `single`'s next.
std::vector<BatchGradients> ExpectGradientsOfOneRank(Trainer& single, Ranks& g, double rtol, const std::string& what,
                                                     Batch* batch_out) {
  const Batch batch = single.data().Next();
  const int P = static_cast<int>(g.trainers.size());
  std::vector<absl::StatusOr<BatchGradients>> grads(static_cast<size_t>(P), absl::UnknownError("not run"));
  g.Run([&](int r) { grads[static_cast<size_t>(r)] = g.at(r).Gradients(batch); });
  absl::StatusOr<BatchGradients> want = single.Gradients(batch);
  EXPECT_TRUE(want.ok()) << what << ": " << want.status();
  if (!want.ok()) return {};
  std::vector<BatchGradients> out;
  for (int r = 0; r < P; ++r) {
    EXPECT_TRUE(grads[static_cast<size_t>(r)].ok()) << what << ": " << grads[static_cast<size_t>(r)].status();
    if (!grads[static_cast<size_t>(r)].ok()) return {};
    ExpectGradientsClose(*grads[static_cast<size_t>(r)], *want, rtol, what + " rank " + std::to_string(r));
    out.push_back(*std::move(grads[static_cast<size_t>(r)]));
  }
  if (batch_out != nullptr) *batch_out = batch;
  return out;
}

// Sharded over a context-parallel group of 2 (the same ranks hold the sequence's halves and the
// parameters' halves): the gradients and the step of one rank.
TEST(ShardingTest, ShardedWithContextParallelEqualsOneRank) {
  TrainerOptions o = Tiny();
  o.memory.recompute = planner::Recompute::kLayer;
  auto single = Trainer::Create(o);
  ASSERT_TRUE(single.ok()) << single.status();
  Ranks g = MakeRanks(2, o, /*context_parallel=*/true);
  for (const auto& t : g.trainers) ASSERT_TRUE(t);
  Batch batch;
  ASSERT_EQ(ExpectGradientsOfOneRank(**single, g, 1e-5, "cp 2", &batch).size(), 2u);
  std::vector<StepResult> results(2);
  g.Run([&](int r) { results[static_cast<size_t>(r)] = g.at(r).Step(batch); });
  const StepResult step = (*single)->Step(batch);
  for (const StepResult& got : results) {
    ASSERT_TRUE(got.status.ok()) << got.status;
    EXPECT_NEAR(got.loss, step.loss, 1e-5 * step.loss);
  }
  const std::string dir = TempDir("cp");
  // 3e-5 of each tensor's largest entry (~2.4e-6 here; a wrong shard or a lost gradient moves
  // weights by ~lr = 1e-3): the first AdamW step is lr g / (|g| + eps), which turns the
  // summation-order noise of tiny gradient entries (sequence halves, then the reduce-scatter)
  // into ~1e-6 of weight; measured 1.4e-6 at most.
  ExpectWeightsClose(SaveAndRead(g, dir), **single, 3e-5, "cp 2 after a step");
  std::filesystem::remove_all(dir);
}

// The hybrid family (hybrid-tiny: KDA and DSA layers, whose A_log and dt_bias stay fp32 in a
// bf16 model, so a KDA layer's unit travels as two buffers): sharded over 2 data-parallel ranks
// (fp32 and bf16) and over a context-parallel pair (fp32, the layers' heads split too), the
// gradients of one rank; the fp32 parameters keep fp32 shards.
TEST(ShardingTest, ShardedHybridEqualsOneRank) {
  torch::set_num_threads(1);
  for (const char* dtype : {"float32", "bfloat16"}) {
    for (bool cp : {false, true}) {
      if (cp && std::string(dtype) == "bfloat16") continue;
      const std::string what = std::string(dtype) + (cp ? " context parallel 2" : " data parallel 2");
      TrainerOptions o = Tiny();
      o.model = "hybrid-tiny";
      o.dtype = dtype;
      o.data.seq_len = 64;
      o.memory.recompute = planner::Recompute::kLayer;
      auto single = Trainer::Create(o);
      ASSERT_TRUE(single.ok()) << single.status();
      Ranks g = MakeRanks(2, o, cp);
      for (const auto& t : g.trainers) ASSERT_TRUE(t);
      // bf16: the ranks' halves summed in fp32 and rounded once, against one bf16 backward.
      const double rtol = std::string(dtype) == "bfloat16" ? 2e-2 : cp ? 1e-4 : 1e-5;
      const std::vector<BatchGradients> grads = ExpectGradientsOfOneRank(**single, g, rtol, what, nullptr);
      ASSERT_EQ(grads.size(), 2u) << what;
      for (const BatchGradients& got : grads)
        EXPECT_EQ(got.grads.at("model.layers.0.self_attn.A_log").scalar_type(), torch::kFloat32) << what;
    }
  }
}

TEST(ShardingTest, RlCallsAreRefused) {
  TrainerOptions o = Tiny();
  o.shard_params = true;
  auto t = Trainer::Create(o);
  ASSERT_TRUE(t.ok()) << t.status();
  AdamWOptions adam;
  absl::StatusOr<OptimStepResult> r = (*t)->OptimStep(adam);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(r.status().message().find("shard_params"), std::string::npos) << r.status();
}

}  // namespace
}  // namespace odyssey::engine
