#include "engine/parallel/data_parallel.h"

#include <algorithm>
#include <utility>

#include <torch/torch.h>

namespace odyssey::engine {

GradientReducer::GradientReducer(Communicator& comm, std::vector<torch::Tensor> params)
    : comm_(comm), params_(std::move(params)), reduced_early_(params_.size(), 0) {}

absl::StatusOr<TokenShare> GradientReducer::ShareTokens(int64_t local_targets, int64_t local_positions) {
  std::vector<torch::Tensor> counts = {
      torch::tensor({static_cast<double>(local_targets), static_cast<double>(local_positions)}, torch::kFloat64)};  // (2,)
  if (absl::Status s = comm_.AllReduce(counts, ReduceOp::kSum); !s.ok()) return s;
  const double targets = counts[0][0].item<double>();
  TokenShare share;
  share.targets = static_cast<int64_t>(targets);
  share.positions = counts[0][1].item<int64_t>();
  share.loss_scale = static_cast<double>(std::max<int64_t>(1, local_targets)) / std::max(1.0, targets);
  return share;
}

absl::Status GradientReducer::Reduce(std::vector<torch::Tensor>& riders) {
  std::vector<int64_t> indices;
  indices.reserve(params_.size());
  for (int64_t i = 0; i < static_cast<int64_t>(params_.size()); ++i)
    if (!reduced_early_[static_cast<size_t>(i)]) indices.push_back(i);
  Forget();
  return ReduceIndices(indices, riders);
}

absl::Status GradientReducer::ReduceEarly(const std::vector<int64_t>& indices) {
  for (int64_t i : indices) reduced_early_.at(static_cast<size_t>(i)) = 1;
  std::vector<torch::Tensor> none;
  return ReduceIndices(indices, none);
}

void GradientReducer::Forget() { std::fill(reduced_early_.begin(), reduced_early_.end(), 0); }

absl::Status GradientReducer::ReduceIndices(const std::vector<int64_t>& indices, std::vector<torch::Tensor>& riders) {
  // The gradients (zeros where this rank has none, so every rank sends the same list), the
  // riders, and which ranks had a gradient per parameter travel in one all-reduce.
  const int64_t P = static_cast<int64_t>(indices.size());
  std::vector<torch::Tensor> reduce;
  reduce.reserve(indices.size() + riders.size() + 1);
  torch::Tensor has_grad = torch::zeros({P}, torch::kFloat32);  // (P,) CPU: 1 where this rank has a gradient
  float* has = has_grad.data_ptr<float>();
  for (int64_t i = 0; i < P; ++i) {
    // A copy of the handle: assigning its grad sets the parameter's.
    torch::Tensor p = params_.at(static_cast<size_t>(indices[static_cast<size_t>(i)]));
    if (p.grad().defined()) {
      has[i] = 1.0f;
    } else {
      p.mutable_grad() = torch::zeros_like(p);
    }
    reduce.push_back(p.grad());
  }
  for (torch::Tensor& r : riders) reduce.push_back(r);
  reduce.push_back(has_grad);
  absl::Status s = comm_.AllReduce(reduce, ReduceOp::kSum);
  // AllReduce wrote into the tensors themselves (gradients, riders, has_grad) in place.
  for (int64_t i = 0; i < P; ++i) {
    if (has[i] == 0) {
      torch::Tensor p = params_.at(static_cast<size_t>(indices[static_cast<size_t>(i)]));
      p.mutable_grad() = torch::Tensor();  // no rank had one: none, as on one rank
    }
  }
  return s;
}

}  // namespace odyssey::engine
