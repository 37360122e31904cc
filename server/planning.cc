// Planning: the planner's verdicts for the controller. CheckFits is CreateJob's memory check
// (one rank of the spec on the largest attached GPU); Plan is PlannerService.Plan, the same
// question answered in full without creating a job; MachineToPlanFor is the machine both plan
// for. Controller member functions: they read the worker registry under mu_.
#include "server/controller.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "model/config.h"
#include "planner/planner.h"

namespace odyssey::server {

namespace v1 = odyssey::v1;

Controller::PlanMachine Controller::MachineToPlanFor() const {
  PlanMachine m;
  const planner::Hardware h200;
  m.gpu_bytes = h200.gpu_bytes;
  m.host_bytes = h200.host_bytes;
  m.source = "an H200 host (no GPU worker is attached)";
  for (const auto& [id, w] : workers_) {
    m.any_worker = true;
    if (w.capabilities.device().rfind("cuda", 0) != 0 || w.capabilities.device_memory_bytes() <= 0) continue;
    const int64_t gpu = w.capabilities.device_memory_bytes() - (int64_t{3} << 30);  // context, fragmentation
    const int64_t host = w.capabilities.host_memory_bytes() / 100 * 85;               // leave the OS its share
    if (!m.gpu_worker || gpu > m.gpu_bytes) {
      m.gpu_bytes = gpu;
      m.host_bytes = host;
      m.source = absl::StrCat("worker ", id, " (", w.capabilities.device_name().empty() ? w.capabilities.device()
                                                                                        : w.capabilities.device_name(),
                              ", the largest GPU attached)");
    }
    m.gpu_worker = true;
  }
  return m;
}

absl::Status Controller::CheckFits(const v1::JobSpec& spec) {
  // The planner models one GPU rank, on MachineToPlanFor(); no check when only CPU workers are
  // attached (they are bound by host memory, which the planner does not model).
  const PlanMachine machine = MachineToPlanFor();
  if (machine.any_worker && !machine.gpu_worker) return absl::OkStatus();
  planner::Hardware hardware;
  hardware.gpu_bytes = machine.gpu_bytes;
  hardware.host_bytes = machine.host_bytes;
  auto config = model::ResolveModelConfig(spec.model().name());
  if (!config.ok()) return absl::OkStatus();  // validation has already named the model's problem
  const int64_t batch = std::max<int64_t>(1, spec.data().batch_size());
  auto choice = planner::Choose(planner::ShapeOf(*config), spec.data().seq_len(), batch, hardware);
  if (!choice.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("spec.data.seq_len: ", choice.status().message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::PlanResponse> Controller::Plan(const v1::PlanRequest& request) {
  const v1::JobSpec& spec = request.spec();
  auto config = model::ResolveModelConfig(spec.model().name());
  if (!config.ok()) return absl::InvalidArgumentError(absl::StrCat("spec.model.name: ", config.status().message()));
  planner::Hardware hardware;
  std::string source;
  {
    absl::MutexLock lock(&mu_);
    const PlanMachine machine = MachineToPlanFor();
    hardware.gpu_bytes = machine.gpu_bytes;
    hardware.host_bytes = machine.host_bytes;
    source = machine.source;
  }
  if (request.gpu_bytes() > 0 || request.host_bytes() > 0) source = "the request";
  if (request.gpu_bytes() > 0) hardware.gpu_bytes = request.gpu_bytes();
  if (request.host_bytes() > 0) hardware.host_bytes = request.host_bytes();
  if (spec.memory().host_budget_bytes() > 0) hardware.host_bytes = spec.memory().host_budget_bytes();

  const planner::ModelShape shape = planner::ShapeOf(*config);
  const int64_t batch = std::max<int64_t>(1, spec.data().batch_size());
  planner::MemoryFields fields;
  fields.recompute = spec.memory().recompute();
  fields.every_k = spec.memory().recompute_every_k();
  fields.offload = spec.memory().offload();
  fields.mlp_tile = spec.memory().mlp_tile_tokens();
  fields.loss_tile = spec.memory().loss_tile_tokens();

  v1::PlanResponse out;
  out.set_planned_gpu_bytes(hardware.gpu_bytes);
  out.set_planned_host_bytes(hardware.host_bytes);
  out.set_hardware(source);
  if (request.max_seq_len()) out.set_max_seq_len(planner::MaxSeqLen(shape, hardware));
  planner::Strategy strategy;  // every field set by the spec: its defaults are what a worker runs
  if (!fields.AllSet()) {
    auto choice = planner::Choose(shape, spec.data().seq_len(), batch, hardware);
    if (!choice.ok()) {  // no strategy: the planner's message says by how much the best one misses
      out.set_fits(false);
      out.set_message(std::string(choice.status().message()));
      return out;
    }
    strategy = choice->strategy;
  }
  planner::Request r;
  r.model = shape;
  r.seq_len = spec.data().seq_len();
  r.batch_size = batch;
  r.strategy = planner::ApplyMemoryFields(strategy, fields);
  r.hardware = hardware;
  r.param_bytes = spec.model().dtype() == "float32" ? 4 : 2;
  const planner::Prediction p = planner::Predict(r);
  out.set_fits(p.fits);
  if (!p.fits) {
    auto gib = [](int64_t b) { return absl::StrFormat("%.1f GiB", static_cast<double>(b) / (int64_t{1} << 30)); };
    out.set_message(absl::StrCat("does not fit: the strategy needs ", gib(p.gpu_peak_bytes), " of GPU memory and ",
                                 gib(p.host_bytes), " of pinned host memory; the machine has ", gib(hardware.gpu_bytes),
                                 " / ", gib(hardware.host_bytes)));
  }
  v1::MemorySpec* m = out.mutable_memory();
  m->set_recompute(r.strategy.recompute);
  m->set_recompute_every_k(static_cast<int32_t>(r.strategy.every_k));
  m->set_offload(r.strategy.offload ? "on" : "off");
  m->set_mlp_tile_tokens(r.strategy.mlp_tile);
  m->set_loss_tile_tokens(r.strategy.loss_tile);
  m->set_host_budget_bytes(hardware.host_bytes);
  out.set_device_resident(r.strategy.device_resident);
  out.set_attention_head_groups(static_cast<int32_t>(r.strategy.head_groups));
  out.set_optimizer_on_host(r.strategy.optimizer_on_host);
  out.set_gpu_peak_bytes(p.gpu_peak_bytes);
  out.set_host_bytes(p.host_bytes);
  for (const auto& [name, bytes] : p.terms) {
    v1::PlanTerm* t = out.add_terms();
    t->set_name(name);
    t->set_bytes(bytes);
  }
  return out;
}

}  // namespace odyssey::server
