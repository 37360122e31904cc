#include "engine/trainer.h"

#include <filesystem>

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace odyssey::engine {
namespace {

TrainerOptions TinyKjv(int64_t steps) {
  TrainerOptions o;
  o.model = "tiny";
  o.device = "cpu";
  o.steps = steps;
  o.optimizer.lr = 3e-3;
  o.optimizer.weight_decay = 0.0;
  o.schedule.warmup_steps = 20;
  o.data.format = "kjv";
  o.data.seq_len = 256;
  o.data.batch_size = 8;
  o.seed = 1;
  return o;
}

// The embedded default learns: the tiny byte-level model on the King James text goes from
// the uniform ~5.5 nats/byte to below 2.5 within a few hundred CPU steps.
TEST(TrainerTest, TinyModelLearnsKingJamesText) {
  torch::set_num_threads(2);
  const int64_t steps = 300;
  auto t = Trainer::Create(TinyKjv(steps));
  ASSERT_TRUE(t.ok()) << t.status();
  Batch held_out = (*t)->data().Next();
  const double before = (*t)->EvalLoss(held_out);
  EXPECT_NEAR(before, std::log(256.0), 0.3);
  double last = 0;
  for (int64_t i = 0; i < steps; ++i) {
    StepResult r = (*t)->TrainStep();
    ASSERT_TRUE(std::isfinite(r.loss));
    last = r.loss;
  }
  const double after = (*t)->EvalLoss(held_out);
  std::printf("loss %.3f -> %.3f (last train step %.3f)\n", before, after, last);
  EXPECT_LT(after, 2.5);
}

// A checkpoint resumes exactly: training 4 steps, saving, and 2 more steps equals a trainer
// restored from the checkpoint doing the same 2 steps.
TEST(TrainerTest, CheckpointResumesExactly) {
  auto dir = std::filesystem::temp_directory_path() / "odyssey_trainer_test_ckpt";
  std::filesystem::remove_all(dir);
  TrainerOptions o = TinyKjv(10);
  o.data.seq_len = 32;
  o.data.batch_size = 2;
  auto a = Trainer::Create(o);
  ASSERT_TRUE(a.ok()) << a.status();
  for (int i = 0; i < 4; ++i) (*a)->TrainStep();
  ASSERT_TRUE((*a)->SaveCheckpoint(dir.string()).ok());
  o.model = dir.string();
  auto b = Trainer::Create(o);
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_TRUE((*b)->LoadCheckpoint(dir.string()).ok());
  EXPECT_EQ((*b)->step(), 4);
  for (int i = 0; i < 2; ++i) {
    Batch batch = (*a)->data().Next();
    StepResult ra = (*a)->Step(batch), rb = (*b)->Step(batch);
    EXPECT_DOUBLE_EQ(ra.loss, rb.loss);
  }
  auto pa = (*a)->model()->named_parameters();
  auto pb = (*b)->model()->named_parameters();
  for (auto& p : pa) EXPECT_TRUE(torch::equal(p.value(), pb[p.key()])) << p.key();
  std::filesystem::remove_all(dir);
}

// The SFT loss is the mean over target positions (loss_mask = 1), not over all positions: a
// batch with half its positions masked out reports the masked positions' mean -log p, which
// equals the loss computed here from the model's logits.
TEST(TrainerTest, LossIsTheMaskedMeanOverTargetTokens) {
  TrainerOptions o = TinyKjv(1);
  o.data.seq_len = 16;
  o.data.batch_size = 2;
  auto t = Trainer::Create(o);
  ASSERT_TRUE(t.ok()) << t.status();
  Batch batch = (*t)->data().Next();
  batch.loss_mask.narrow(1, 0, 8).zero_();  // (B, S): the first half of every row does not count
  ASSERT_EQ(batch.NumTargets(), 2 * 8);
  torch::Tensor ref;
  {
    torch::NoGradGuard no_grad;
    model::ForwardInputs in;
    in.input_ids = batch.input_ids;
    in.position_ids = batch.position_ids;
    torch::Tensor logits = torch::matmul((*t)->model()->Hidden(in), (*t)->model()->HeadWeight().t());  // (B, S, V)
    torch::Tensor nll = -torch::log_softmax(logits, -1).gather(2, batch.labels.unsqueeze(2)).squeeze(2);  // (B, S)
    ref = (nll * batch.loss_mask).sum() / batch.loss_mask.sum();
  }
  EXPECT_NEAR((*t)->EvalLoss(batch), ref.item<double>(), 1e-5);
}

TEST(TrainerTest, BadOptionsNameTheField) {
  TrainerOptions o = TinyKjv(0);
  auto r = Trainer::Create(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("steps (0) must be > 0"), std::string::npos) << r.status();
  o = TinyKjv(1);
  o.data.seq_len = 5000;
  r = Trainer::Create(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("data.seq_len (5000) must be <= the model's max_position_embeddings (4096)"),
            std::string::npos)
      << r.status();
  o = TinyKjv(1);
  o.device = "tpu";
  r = Trainer::Create(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("device 'tpu'"), std::string::npos) << r.status();
  o = TinyKjv(1);
  o.attention = "magic";
  r = Trainer::Create(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("attention backend 'magic'"), std::string::npos) << r.status();
}

}  // namespace
}  // namespace odyssey::engine
