#include "engine/optimizer.h"

#include <cmath>
#include <map>

#include <torch/torch.h>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/device_stats.h"
#include "kernels/fused_ops.h"

namespace odyssey::engine {

absl::Status AdamWOptions::Validate() const {
  if (!(lr > 0) || !std::isfinite(lr)) return absl::InvalidArgumentError(absl::StrCat("optimizer.lr (", lr, ") must be > 0"));
  if (!(beta1 >= 0 && beta1 < 1)) return absl::InvalidArgumentError(absl::StrCat("optimizer.beta1 (", beta1, ") must be in [0, 1)"));
  if (!(beta2 >= 0 && beta2 < 1)) return absl::InvalidArgumentError(absl::StrCat("optimizer.beta2 (", beta2, ") must be in [0, 1)"));
  if (!(eps > 0)) return absl::InvalidArgumentError(absl::StrCat("optimizer.eps (", eps, ") must be > 0"));
  if (!(weight_decay >= 0)) return absl::InvalidArgumentError(absl::StrCat("optimizer.weight_decay (", weight_decay, ") must be >= 0"));
  return absl::OkStatus();
}

absl::Status ScheduleOptions::Validate() const {
  if (warmup_steps < 0) return absl::InvalidArgumentError(absl::StrCat("schedule.warmup_steps (", warmup_steps, ") must be >= 0"));
  if (total_steps < 0) return absl::InvalidArgumentError(absl::StrCat("schedule.total_steps (", total_steps, ") must be >= 0"));
  if (!(min_lr_ratio >= 0 && min_lr_ratio <= 1))
    return absl::InvalidArgumentError(absl::StrCat("schedule.min_lr_ratio (", min_lr_ratio, ") must be in [0, 1]"));
  return absl::OkStatus();
}

double ScheduledLr(double peak, int64_t done, const ScheduleOptions& s) {
  if (done < s.warmup_steps) return peak * static_cast<double>(done + 1) / static_cast<double>(s.warmup_steps);
  if (s.total_steps <= s.warmup_steps) return peak;
  const double progress = std::min(1.0, static_cast<double>(done - s.warmup_steps) /
                                            static_cast<double>(std::max<int64_t>(1, s.total_steps - s.warmup_steps)));
  return peak * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + std::cos(M_PI * progress)));
}

double GradNorm(const std::vector<torch::Tensor>& params) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> norms;
  for (const auto& p : params) {
    if (p.grad().defined()) norms.push_back(p.grad().to(torch::kFloat32).norm());
  }
  if (norms.empty()) return 0.0;
  return torch::stack(norms).norm().item<double>();
}

double ClipScale(double norm, double max_norm) { return max_norm > 0 && norm > max_norm ? max_norm / (norm + 1e-6) : 1.0; }

double ClipGradNorm(const std::vector<torch::Tensor>& params, double max_norm) {
  torch::NoGradGuard no_grad;
  const double total = GradNorm(params);
  const double coef = ClipScale(total, max_norm);
  if (coef != 1.0) {
    for (const auto& p : params) {
      if (p.grad().defined()) p.grad().mul_(coef);
    }
  }
  return total;
}

GradClip GradClipScale(const std::vector<torch::Tensor>& params, double max_norm,
                       const torch::Tensor& released_squares) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> grads;
  for (const auto& p : params) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  GradClip out;
  if (grads.empty() && !released_squares.defined()) {
    out.norm = torch::zeros({}, torch::kFloat32);
    if (max_norm > 0) out.scale = torch::ones({}, torch::kFloat32);
    return out;
  }
  if (grads.empty()) {
    out.norm = released_squares.to(torch::kFloat32).sqrt();
  } else {
    // Per-tensor norms accumulated in fp32 from the bf16 gradients (no fp32 copies of them).
    std::vector<torch::Tensor> norms = at::_foreach_norm(grads, 2, torch::kFloat32);
    out.norm = released_squares.defined() ? (torch::stack(norms).square().sum() + released_squares).sqrt()
                                          : torch::stack(norms).norm();  // ()
  }
  if (max_norm > 0) out.scale = (max_norm / (out.norm + 1e-6)).clamp_max(1.0);
  return out;
}

AdamW::AdamW(std::vector<std::pair<std::string, torch::Tensor>> named_params, const AdamWOptions& options,
             bool states_on_host, const HostOptimizerOptions& host)
    : options_(options) {
  TORCH_CHECK(states_on_host || !host.bf16_moments,
              "bf16 moments need the optimizer state on the host (memory.optimizer_on_host)");
  torch::NoGradGuard no_grad;
  if (states_on_host) {
    std::vector<torch::Tensor> params;
    for (const auto& [name, p] : named_params) params.push_back(p);
    host_ = std::make_unique<HostAdamW>(std::move(params), host);
  }
  for (auto& [name, p] : named_params) {
    Slot s;
    s.name = name;
    s.param = p;
    s.decay = DecaysWeights(p);
    if (host_) {
      const HostAdamW::State state = host_->state(slots_.size());
      s.on_host = true;
      s.master = state.master;
      s.exp_avg = state.exp_avg;
      s.exp_avg_sq = state.exp_avg_sq;
    } else {
      // fp32 params are their own master: no redundant copy.
      s.master = p.scalar_type() == torch::kFloat32 ? p : p.detach().to(torch::kFloat32).clone();
      s.exp_avg = torch::zeros_like(s.master);
      s.exp_avg_sq = torch::zeros_like(s.master);
    }
    slots_.push_back(std::move(s));
  }
}

void AdamW::Step(double lr, const torch::Tensor& grad_scale) {
  torch::NoGradGuard no_grad;
  ++steps_;
  if (host_) {
    AdamWStep step;
    step.lr = lr;
    step.beta1 = options_.beta1;
    step.beta2 = options_.beta2;
    step.eps = options_.eps;
    step.weight_decay = options_.weight_decay;
    step.step = steps_;
    // The host threads need the factor as a number: the one wait for the device in a host step.
    step.grad_scale = grad_scale.defined() ? grad_scale.item<double>() : 1.0;
    host_->Step(step);
    return;
  }
  const double b1 = options_.beta1, b2 = options_.beta2;
  const double bc1 = 1 - std::pow(b1, static_cast<double>(steps_));
  const double bc2 = 1 - std::pow(b2, static_cast<double>(steps_));
  for (Slot& s : slots_) {
    if (!s.param.grad().defined()) continue;
    kernels::AdamWUpdate(s.param, s.param.grad(), s.master, s.exp_avg, s.exp_avg_sq, grad_scale,
                         {lr, b1, b2, options_.eps, s.decay ? options_.weight_decay : 0.0, bc1, bc2});
  }
}

void AdamW::Step(double lr, double grad_scale) {
  if (grad_scale == 1.0 || slots_.empty()) {
    Step(lr, torch::Tensor());
    return;
  }
  Step(lr, torch::full({}, grad_scale, torch::dtype(torch::kFloat32).device(slots_.front().param.device())));
}

void AdamW::GradsReady(const std::vector<int64_t>& indices) {
  if (host_) host_->GradsReady(indices);
}

void AdamW::ReleaseGrads(const std::vector<int64_t>& indices) {
  if (host_) host_->ReleaseGrads(indices);
}

torch::Tensor AdamW::ReleasedGradSquares() const { return host_ ? host_->ReleasedGradSquares() : torch::Tensor(); }

void AdamW::WaitParams(const std::vector<int64_t>& indices) {
  if (host_) host_->WaitParams(indices);
}

void AdamW::Finish() {
  if (host_) host_->Finish();
}

void AdamW::ZeroGrad() {
  for (Slot& s : slots_) {
    if (s.param.grad().defined()) s.param.mutable_grad() = torch::Tensor();
  }
  if (host_) host_->DropGrads();
}

std::vector<std::pair<std::string, torch::Tensor>> AdamW::StateTensors() const {
  // Host state: the update in flight ends first.
  if (host_) host_->Finish();
  std::vector<std::pair<std::string, torch::Tensor>> out;
  out.emplace_back("step", torch::tensor(steps_, torch::kInt64));
  for (const Slot& s : slots_) {
    // bf16 moments go out as fp32 (exact): checkpoints keep one format.
    out.emplace_back("exp_avg." + s.name, s.exp_avg.to(torch::kFloat32));
    out.emplace_back("exp_avg_sq." + s.name, s.exp_avg_sq.to(torch::kFloat32));
    if (!s.master.is_same(s.param) && (s.param.scalar_type() != torch::kFloat32 || !s.on_host)) {
      out.emplace_back("master." + s.name, s.master);
    }
  }
  return out;
}

absl::Status AdamW::LoadStateTensors(const std::vector<std::pair<std::string, torch::Tensor>>& tensors) {
  std::map<std::string, torch::Tensor> by_name(tensors.begin(), tensors.end());
  auto get = [&](const std::string& name, const torch::Tensor& like) -> absl::StatusOr<torch::Tensor> {
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      return absl::NotFoundError(absl::StrCat(
          "optimizer state: missing tensor '", name, "'",
          absl::StartsWith(name, "master.") ? " (fp32 master weights: the checkpoint was written by a float32 run, "
                                              "this one computes in a lower precision; set model.dtype as it was)"
                                            : " (a checkpoint of another model?)"));
    }
    if (it->second.sizes() != like.sizes()) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer state: tensor '", name, "' has shape [",
                                                     absl::StrJoin(it->second.sizes(), ", "), "], the model's is [",
                                                     absl::StrJoin(like.sizes(), ", "), "]"));
    }
    return it->second;
  };
  auto step = by_name.find("step");
  if (step == by_name.end() || step->second.numel() != 1)
    return absl::NotFoundError("optimizer state: missing scalar 'step'");
  torch::NoGradGuard no_grad;
  if (host_) host_->Finish();  // no update in flight may overwrite what is loaded
  for (Slot& s : slots_) {
    auto m = get("exp_avg." + s.name, s.exp_avg);
    if (!m.ok()) return m.status();
    auto v = get("exp_avg_sq." + s.name, s.exp_avg_sq);
    if (!v.ok()) return v.status();
    // Into bf16 moments (bf16_moments): rounded to nearest even, as the kernel stores them.
    s.exp_avg.copy_(*m);
    s.exp_avg_sq.copy_(*v);
    if (s.param.scalar_type() != torch::kFloat32) {
      auto w = get("master." + s.name, s.master);
      if (!w.ok()) return w.status();
      s.master.copy_(*w);
      s.param.copy_(s.master);
    } else if (s.on_host && !s.master.is_alias_of(s.param)) {
      s.master.copy_(s.param);  // an fp32 param is its own master; the host copy follows it
    }
  }
  steps_ = step->second.item<int64_t>();
  return absl::OkStatus();
}

}  // namespace odyssey::engine
