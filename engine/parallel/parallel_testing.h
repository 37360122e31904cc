// Test-only helpers shared by the parallel trainers' tests (context_parallel_test, sharding_test,
// data_parallel_test, rl_data_parallel_test): a reference trainer given the ranks' start, and
// comparisons of weights and gradients. Header-only (inline functions).
#pragma once

#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "engine/trainer.h"

namespace odyssey::engine::parallel_testing {

// Random init draws from the process generator, so trainers created concurrently (the ranks'
// threads) do not get the seed's weights; the broadcast from rank 0 makes the ranks agree, and
// this gives a single-rank reference the same start.
inline void CopyWeights(Trainer& from, Trainer& to) {
  torch::NoGradGuard no_grad;
  auto src = from.model()->named_parameters();
  for (auto& p : to.model()->named_parameters()) p.value().copy_(src[p.key()]);
}

// Every parameter bitwise equal.
inline void ExpectWeightsEqual(Trainer& a, Trainer& b, const std::string& what) {
  auto pa = a.model()->named_parameters();
  auto pb = b.model()->named_parameters();
  for (auto& p : pa) EXPECT_TRUE(torch::equal(p.value(), pb[p.key()])) << what << ": " << p.key();
}

// The loss within `rtol`, and every parameter's gradient (same shape) within `rtol` of the
// largest entry of want's.
inline void ExpectGradientsClose(const BatchGradients& got, const BatchGradients& want, double rtol,
                                 const std::string& what) {
  EXPECT_NEAR(got.loss, want.loss, rtol * want.loss) << what << " loss";
  ASSERT_EQ(got.grads.size(), want.grads.size()) << what;
  for (const auto& [name, g] : want.grads) {
    ASSERT_TRUE(got.grads.count(name)) << what << ": no gradient for " << name;
    ASSERT_EQ(got.grads.at(name).sizes(), g.sizes()) << what << ": " << name;
    const double scale = g.abs().max().item<double>();
    const double err = (got.grads.at(name) - g).abs().max().item<double>();
    EXPECT_GT(scale, 0) << what << ": " << name;
    EXPECT_LE(err, rtol * scale) << what << ": " << name << " (largest entry " << scale << ")";
  }
}

}  // namespace odyssey::engine::parallel_testing
