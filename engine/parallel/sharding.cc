#include "engine/parallel/sharding.h"

#include <algorithm>

#include <torch/torch.h>

#include "absl/strings/str_cat.h"

namespace odyssey::engine {

absl::StatusOr<std::unique_ptr<ShardedParameters>> ShardedParameters::Create(
    Communicator& group, std::vector<std::pair<std::string, torch::Tensor>> named,
    std::vector<std::vector<int64_t>> units) {
  torch::NoGradGuard no_grad;
  const int64_t P = group.world_size(), r = group.rank();
  std::vector<int64_t> owner(named.size(), -1);
  std::vector<Unit> built(units.size());
  for (size_t u = 0; u < units.size(); ++u) {
    for (int64_t i : units[u]) {
      if (i < 0 || i >= static_cast<int64_t>(named.size()))
        return absl::InvalidArgumentError(absl::StrCat("sharding: unit ", u, " names parameter ", i, " of ", named.size()));
      if (owner[static_cast<size_t>(i)] >= 0)
        return absl::InvalidArgumentError(
            absl::StrCat("sharding: parameter ", named[static_cast<size_t>(i)].first, " is in two units"));
      owner[static_cast<size_t>(i)] = static_cast<int64_t>(u);
    }
    built[u].params = units[u];
  }
  std::vector<Param> params;
  params.reserve(named.size());
  for (size_t i = 0; i < named.size(); ++i) {
    if (owner[i] < 0) return absl::InvalidArgumentError(absl::StrCat("sharding: parameter ", named[i].first, " is in no unit"));
    Param p;
    p.name = named[i].first;
    p.param = named[i].second;
    p.shape = p.param.sizes().vec();
    p.numel = p.param.numel();
    p.shard_numel = (p.numel + P - 1) / P;
    // This rank's slice, zero-padded past the end: (n,), then (1, n) for 2+-D parameters.
    torch::Tensor flat = p.param.detach().reshape({-1});  // (N,)
    const int64_t begin = std::min(p.numel, r * p.shard_numel), end = std::min(p.numel, (r + 1) * p.shard_numel);
    torch::Tensor shard = torch::zeros({p.shard_numel}, p.param.options().requires_grad(false));  // (n,)
    shard.slice(0, 0, end - begin).copy_(flat.slice(0, begin, end));
    if (p.param.dim() >= 2) shard = shard.view({1, p.shard_numel});
    p.shard = shard.requires_grad_(true);  // a leaf the optimizer reads .grad() of
    params.push_back(std::move(p));
  }
  for (Unit& u : built) {
    std::vector<torch::ScalarType> dtypes;
    for (int64_t i : u.params) {
      const Param& p = params[static_cast<size_t>(i)];
      const auto it = std::find(dtypes.begin(), dtypes.end(), p.shard.scalar_type());
      const size_t part = static_cast<size_t>(it - dtypes.begin());
      if (it == dtypes.end()) {
        dtypes.push_back(p.shard.scalar_type());
        u.parts.emplace_back();
      }
      u.parts[part].params.push_back(i);
      u.parts[part].shard_numel += p.shard_numel;
    }
  }
  auto sharded = std::unique_ptr<ShardedParameters>(new ShardedParameters(group, std::move(params), std::move(built)));
  // Whole from the start: released now, so that only the shards stay.
  for (Unit& u : sharded->units_) u.whole = true;
  sharded->ReleaseAll();
  return sharded;
}

ShardedParameters::ShardedParameters(Communicator& group, std::vector<Param> params, std::vector<Unit> units)
    : group_(group), params_(std::move(params)), units_(std::move(units)) {}

std::vector<std::pair<std::string, torch::Tensor>> ShardedParameters::NamedShards() const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const Param& p : params_) out.emplace_back(p.name, p.shard);
  return out;
}

std::vector<torch::Tensor> ShardedParameters::Shards() const {
  std::vector<torch::Tensor> out;
  for (const Param& p : params_) out.push_back(p.shard);
  return out;
}

torch::Tensor ShardedParameters::FlatShards(const Part& part) const {
  std::vector<torch::Tensor> flat;
  for (int64_t i : part.params) flat.push_back(params_[static_cast<size_t>(i)].shard.detach().reshape({-1}));
  return torch::cat(flat);  // (sum n,)
}

void ShardedParameters::Prefetch(int64_t unit) {
  if (unit < 0 || unit >= num_units()) return;
  Unit& u = units_[static_cast<size_t>(unit)];
  if (u.whole || !u.pending.empty()) return;
  torch::NoGradGuard no_grad;
  for (const Part& part : u.parts) u.pending.push_back(group_.StartAllGather(FlatShards(part)));
}

void ShardedParameters::Gather(int64_t unit) {
  TORCH_CHECK(unit >= 0 && unit < num_units(), "sharding: unit ", unit, " out of [0, ", num_units(), ")");
  Unit& u = units_[static_cast<size_t>(unit)];
  if (u.whole) return;
  Prefetch(unit);
  std::vector<std::unique_ptr<PendingCollective>> pending = std::move(u.pending);
  u.pending.clear();
  torch::NoGradGuard no_grad;
  for (size_t k = 0; k < u.parts.size(); ++k) {
    const Part& part = u.parts[k];
    absl::StatusOr<torch::Tensor> gathered = pending[k]->Wait();  // (P sum n,) rank-major
    TORCH_CHECK(gathered.ok(), "parameter all-gather failed: ", gathered.status().ToString());
    const torch::Tensor rows = gathered->view({group_.world_size(), part.shard_numel});  // (P, sum n)
    int64_t offset = 0;
    for (int64_t i : part.params) {
      Param& p = params_[static_cast<size_t>(i)];
      // (P, n) -> (P n,), the padding cut, in the parameter's shape: its own storage.
      torch::Tensor whole = rows.slice(1, offset, offset + p.shard_numel).reshape({-1}).slice(0, 0, p.numel);
      p.param.set_data(whole.contiguous().view(p.shape));
      offset += p.shard_numel;
    }
  }
  u.whole = true;
}

void ShardedParameters::Release(int64_t unit) {
  Unit& u = units_.at(static_cast<size_t>(unit));
  if (!u.whole) return;
  for (int64_t i : u.params) {
    Param& p = params_[static_cast<size_t>(i)];
    p.param.mutable_grad() = torch::Tensor();
    p.param.set_data(torch::empty({0}, p.shard.options().requires_grad(false)));
  }
  u.whole = false;
}

void ShardedParameters::ReduceGradients(int64_t unit) {
  Unit& u = units_.at(static_cast<size_t>(unit));
  TORCH_CHECK(u.whole, "sharding: unit ", unit, " reduced while not whole");
  torch::NoGradGuard no_grad;
  const int64_t P = group_.world_size();
  for (const Part& part : u.parts) {
    // (P, sum n): row r holds what rank r owns of every parameter's gradient.
    std::vector<torch::Tensor> columns;
    for (int64_t i : part.params) {
      const Param& p = params_[static_cast<size_t>(i)];
      torch::Tensor g = p.param.grad();
      torch::Tensor padded = torch::zeros({P * p.shard_numel}, p.shard.options().requires_grad(false));  // (P n,)
      if (g.defined()) padded.slice(0, 0, p.numel).copy_(g.reshape({-1}));
      columns.push_back(padded.view({P, p.shard_numel}));
    }
    absl::StatusOr<torch::Tensor> mine = group_.ReduceScatter(torch::cat(columns, 1));  // (sum n,)
    TORCH_CHECK(mine.ok(), "gradient reduce-scatter failed: ", mine.status().ToString());
    int64_t offset = 0;
    for (int64_t i : part.params) {
      Param& p = params_[static_cast<size_t>(i)];
      torch::Tensor g = mine->slice(0, offset, offset + p.shard_numel).view(p.shard.sizes());
      if (p.shard.grad().defined()) {
        p.shard.mutable_grad().add_(g);  // gradients accumulate over backwards, as on whole parameters
      } else {
        p.shard.mutable_grad() = g.clone();
      }
      offset += p.shard_numel;
    }
  }
  Release(unit);
}

absl::Status ShardedParameters::FinishBackward() {
  for (int64_t u = 0; u < num_units(); ++u) {
    if (!units_[static_cast<size_t>(u)].whole) continue;
    try {
      ReduceGradients(u);
    } catch (const c10::Error& e) {
      return absl::UnavailableError(e.what_without_backtrace());
    }
  }
  return absl::OkStatus();
}

void ShardedParameters::ReleaseAll() {
  for (int64_t u = 0; u < num_units(); ++u) Release(u);
}

absl::Status ShardedParameters::GatherAll() {
  for (int64_t u = 0; u < num_units(); ++u) {
    try {
      Gather(u);
    } catch (const c10::Error& e) {
      return absl::UnavailableError(e.what_without_backtrace());
    }
  }
  return absl::OkStatus();
}

void ShardedParameters::ShardWholeParameters() {
  torch::NoGradGuard no_grad;
  const int64_t r = group_.rank();
  for (Param& p : params_) {
    TORCH_CHECK(p.param.numel() == p.numel, "sharding: ", p.name, " is not whole");
    torch::Tensor flat = p.param.detach().reshape({-1});  // (N,)
    const int64_t begin = std::min(p.numel, r * p.shard_numel), end = std::min(p.numel, (r + 1) * p.shard_numel);
    torch::Tensor shard = p.shard.detach().view({-1});  // (n,) a view: writes reach the shard
    shard.zero_();
    shard.slice(0, 0, end - begin).copy_(flat.slice(0, begin, end));
  }
}

absl::StatusOr<GradClip> ShardedParameters::ClipScale(double max_norm) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> grads;
  for (const Param& p : params_)
    if (p.shard.grad().defined()) grads.push_back(p.shard.grad());
  // This rank's sum of squares (fp32 per tensor, fp64 across), summed over the ranks: the padding
  // is zero, so the sum is the whole gradients'.
  torch::Tensor local = torch::zeros({1}, torch::kFloat64);  // (1,) CPU
  if (!grads.empty()) {
    std::vector<torch::Tensor> norms = at::_foreach_norm(grads, 2, torch::kFloat32);
    local = torch::stack(norms).to(torch::kFloat64).square().sum().reshape({1}).to(torch::kCPU);
  }
  std::vector<torch::Tensor> sums = {local};
  if (absl::Status s = group_.AllReduce(sums, ReduceOp::kSum); !s.ok()) return s;
  const torch::Device device = params_.empty() ? torch::Device(torch::kCPU) : params_[0].shard.device();
  GradClip out;
  out.norm = sums[0].sqrt().to(torch::kFloat32).reshape({}).to(device);  // ()
  if (max_norm > 0) out.scale = (max_norm / (out.norm + 1e-6)).clamp_max(1.0);
  return out;
}

const ShardedParameters::Param* ShardedParameters::Find(const std::string& name) const {
  for (const Param& p : params_)
    if (p.name == name) return &p;
  return nullptr;
}

absl::StatusOr<torch::Tensor> ShardedParameters::GatherWhole(const std::string& name, const torch::Tensor& shard_like) {
  const Param* p = Find(name);
  if (p == nullptr) return absl::NotFoundError(absl::StrCat("sharding: no parameter ", name));
  if (shard_like.numel() != p->shard_numel)
    return absl::InvalidArgumentError(absl::StrCat("sharding: ", name, " has ", shard_like.numel(),
                                                   " elements on this rank, its shard ", p->shard_numel));
  absl::StatusOr<torch::Tensor> all = group_.AllGather(shard_like.detach().contiguous());  // (P n,)
  if (!all.ok()) return all.status();
  return all->slice(0, 0, p->numel).contiguous().view(p->shape);
}

absl::StatusOr<torch::Tensor> ShardedParameters::ShardOf(const std::string& name, const torch::Tensor& whole) const {
  const Param* p = Find(name);
  if (p == nullptr) return absl::NotFoundError(absl::StrCat("sharding: no parameter ", name));
  if (whole.numel() != p->numel)
    return absl::InvalidArgumentError(
        absl::StrCat("sharding: ", name, " has ", whole.numel(), " elements, the model's parameter ", p->numel));
  const int64_t r = group_.rank();
  const int64_t begin = std::min(p->numel, r * p->shard_numel), end = std::min(p->numel, (r + 1) * p->shard_numel);
  torch::Tensor shard = torch::zeros({p->shard_numel}, whole.options().device(p->shard.device()));  // (n,)
  shard.slice(0, 0, end - begin).copy_(whole.detach().reshape({-1}).slice(0, begin, end));
  return shard.view(p->shard.sizes());
}

absl::StatusOr<std::map<std::string, torch::Tensor>> ShardedParameters::WholeGradients() {
  // Every rank gathers the same list: a gradient is defined on all ranks or none (reduce-scatter).
  std::map<std::string, torch::Tensor> out;
  for (const Param& p : params_) {
    if (!p.shard.grad().defined()) continue;
    absl::StatusOr<torch::Tensor> g = GatherWhole(p.name, p.shard.grad());
    if (!g.ok()) return g.status();
    out[p.name] = *std::move(g);
  }
  return out;
}

}  // namespace odyssey::engine
