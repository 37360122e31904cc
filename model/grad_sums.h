// Weight gradients summed in fp32 over the tiles of one backward (tiled MLP, MoE tiles), then
// written once into .grad: letting each tile's backward add into a bf16 .grad would round the
// running sum once per tile (~96 times at 1M tokens). Used by engine/memory/checkpoint.cc
// (TiledMlpBlock) and model/moe.cc.
// Thread safety: one backward at a time.
#pragma once

#include <cstddef>
#include <vector>

#include <torch/torch.h>

namespace odyssey::model {

class Fp32GradSums {
 public:
  explicit Fp32GradSums(std::vector<torch::Tensor> weights)
      : weights_(std::move(weights)), sums_(weights_.size()) {}

  const std::vector<torch::Tensor>& weights() const { return weights_; }

  // Adds one tile's gradients: d[i] for weights()[i], undefined where the tile gave none (an
  // expert no token of the tile chose).
  void Add(const std::vector<torch::Tensor>& d) {
    for (size_t i = 0; i < weights_.size(); ++i) {
      if (!d[i].defined()) continue;
      if (sums_[i].defined()) {
        sums_[i].add_(d[i]);
      } else {
        sums_[i] = d[i].scalar_type() == torch::kFloat64 ? d[i].clone() : d[i].to(torch::kFloat32);
      }
    }
  }

  // One rounding of each whole sum into .grad (added to what earlier backwards left there).
  void WriteGrads() {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < weights_.size(); ++i) {
      if (!sums_[i].defined()) continue;
      torch::Tensor& grad = weights_[i].mutable_grad();
      if (grad.defined()) {
        grad.add_(sums_[i]);
      } else {
        grad = sums_[i].to(weights_[i].scalar_type());
      }
    }
  }

 private:
  std::vector<torch::Tensor> weights_;
  std::vector<torch::Tensor> sums_;  // fp32 (fp64 for fp64 weights), each its weight's shape
};

}  // namespace odyssey::model
