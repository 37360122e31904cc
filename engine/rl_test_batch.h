// Test-only helpers shared by the RL tests (rl_loss_test, rl_data_parallel_test): float vector
// <-> tensor conversion and a random batch of datums with every per-token input filled in.
// Header-only; include from one test translation unit each (functions are inline).
#pragma once

#include <cstdint>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "engine/rl_loss.h"
#include "engine/trainer.h"

namespace odyssey::engine::rl_testing {

inline std::vector<float> ToFloats(const torch::Tensor& t) {
  torch::Tensor c = t.detach().to(torch::kFloat32).contiguous();
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

inline torch::Tensor FromFloats(const std::vector<float>& v) { return torch::tensor(torch::ArrayRef<float>(v)); }

// Datums of the given (awkward) lengths: random tokens in [0, vocab), targets = tokens shifted
// by one, weights in [0, 2) with the first two positions (a "prompt") at 0, advantages N(0, 1),
// and sampler logprobs = the trainer's own + N(0, 0.3) noise, so that PPO's clip is active for
// some tokens. Deterministic given `seed` (it reseeds torch's generator).
inline std::vector<Datum> RandomBatch(Trainer& trainer, uint64_t seed, const std::vector<int64_t>& lengths,
                                      int64_t vocab = 256) {
  torch::manual_seed(seed);
  std::vector<Datum> batch;
  for (int64_t S : lengths) {
    torch::Tensor seq = torch::randint(0, vocab, {S + 1}, torch::kInt64);  // (S + 1,)
    Datum d;
    d.tokens.assign(seq.data_ptr<int64_t>(), seq.data_ptr<int64_t>() + S);
    d.target_tokens.assign(seq.data_ptr<int64_t>() + 1, seq.data_ptr<int64_t>() + S + 1);
    torch::Tensor w = torch::rand({S}) * 2;  // (S,)
    w.slice(0, 0, 2).zero_();
    d.weights = ToFloats(w);
    d.advantages = ToFloats(torch::randn({S}));
    batch.push_back(std::move(d));
  }
  absl::StatusOr<std::vector<std::vector<float>>> logp = trainer.Forward(batch);
  EXPECT_TRUE(logp.ok()) << logp.status();
  for (size_t i = 0; i < batch.size(); ++i) {
    torch::Tensor q = FromFloats((*logp)[i]) + 0.3 * torch::randn({static_cast<int64_t>(batch[i].tokens.size())});  // (S,)
    batch[i].sampler_logprobs = ToFloats(q);
  }
  return batch;
}

}  // namespace odyssey::engine::rl_testing
