// Repeating attention heads in place and summing the repeats back: the GQA layout change
// (KV heads -> one per query head) of kernels that need it, Ulysses' KV replication over
// ranks, and KDA's q/k heads per value head share these two.
#pragma once

#include <cstdint>

#include <torch/types.h>

namespace odyssey::kernels {

// (B, n, S, D) -> (B, n * factor, S, D), each head repeated `factor` times in place
// (head h at h * factor .. h * factor + factor - 1). Differentiable; `t` itself when factor is 1.
torch::Tensor RepeatHeads(const torch::Tensor& t, int64_t factor);
// The reverse for gradients: (B, n * f, S, D) -> (B, n, S, D), summing each head's f repeats.
// REQUIRES: heads divides g.size(1).
torch::Tensor SumHeadRepeats(const torch::Tensor& g, int64_t heads);

}  // namespace odyssey::kernels
