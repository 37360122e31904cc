// Planning: the planner's verdicts for the controller, both by the one planning rule
// (planner::PlanJobSpec). CheckFits is CreateJob's memory check (one rank of the spec on the
// largest attached GPU); Plan is PlannerService.Plan, the same question answered in full
// without creating a job; MachineToPlanFor and PlanHardware are the machine both plan for. Controller member functions: they read the worker registry under mu_.
#include "server/controller.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "model/config.h"
#include "planner/memory_spec.h"
#include "planner/planner.h"

namespace odyssey::server {

namespace v1 = odyssey::v1;

Controller::PlanMachine Controller::MachineToPlanFor() const {
  PlanMachine m;
  m.source = "an H200 host (no GPU worker is attached)";
  for (const auto& [id, w] : workers_) {
    m.any_worker = true;
    if (w.capabilities.device().rfind("cuda", 0) != 0 || w.capabilities.device_memory_bytes() <= 0) continue;
    if (!m.gpu_worker || w.capabilities.device_memory_bytes() > m.device_memory_bytes) {
      m.device_memory_bytes = w.capabilities.device_memory_bytes();
      m.host_memory_bytes = w.capabilities.host_memory_bytes();
      m.source = absl::StrCat("worker ", id, " (", w.capabilities.device_name().empty() ? w.capabilities.device()
                                                                                        : w.capabilities.device_name(),
                              ", the largest GPU attached)");
    }
    m.gpu_worker = true;
  }
  if (m.any_worker && !m.gpu_worker) {
    m.cpu = true;
    for (const auto& [id, w] : workers_) {
      if (w.capabilities.host_memory_bytes() > m.host_memory_bytes) {
        m.host_memory_bytes = w.capabilities.host_memory_bytes();
        m.source = absl::StrCat("CPU worker ", id, " (", absl::StrFormat("%.1f", w.capabilities.host_memory_bytes() / double(1 << 30)),
                                " GiB host memory, the most of the attached CPU workers)");
      }
    }
    if (m.host_memory_bytes <= 0) {  // no worker said: nothing to check against
      m.cpu = false;
      m.source = "an H200 host (the attached CPU workers report no host memory)";
    }
  }
  return m;
}

namespace {

// The spec as the planner reads it on `hw`: a CPU rank runs dtype auto as float32.
v1::JobSpec PlannedSpec(const v1::JobSpec& spec, const planner::Hardware& hw) {
  v1::JobSpec out = spec;
  if (hw.cpu && (spec.model().dtype().empty() || spec.model().dtype() == "auto")) {
    out.mutable_model()->set_dtype("float32");
  }
  return out;
}

}  // namespace

planner::Hardware Controller::PlanHardware(const PlanMachine& machine, int64_t spec_host_budget_bytes) {
  planner::Hardware h;  // an H200 host's when no worker is attached
  if (machine.cpu) {
    h = planner::CpuHardware(machine.host_memory_bytes, spec_host_budget_bytes);
  } else if (machine.gpu_worker) {
    h = planner::MachineHardware(machine.device_memory_bytes, machine.host_memory_bytes, spec_host_budget_bytes);
  } else if (spec_host_budget_bytes > 0) {
    h.host_bytes = spec_host_budget_bytes;
  }
  return h;
}

absl::Status Controller::CheckFits(const v1::JobSpec& spec) {
  const PlanMachine machine = MachineToPlanFor();
  // A model that does not resolve is validation's to name (ValidateJobSpec runs at the edge).
  absl::StatusOr<model::ModelConfig> config = planner::SpecModelConfig(spec);
  if (!config.ok()) return absl::OkStatus();
  const planner::Hardware hw = PlanHardware(machine, spec.memory().host_budget_bytes());
  absl::StatusOr<planner::JobPlan> plan = planner::PlanJobSpec(PlannedSpec(spec, hw), *config, hw);
  if (!plan.ok()) return plan.status();
  if (!plan->fits) {
    return absl::FailedPreconditionError(absl::StrCat("spec.data.seq_len: ", plan->message, " (planned for ",
                                                      machine.source, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::PlanResponse> Controller::Plan(const v1::PlanRequest& request) {
  const v1::JobSpec& spec = request.spec();
  absl::StatusOr<model::ModelConfig> config = planner::SpecModelConfig(spec);
  if (!config.ok()) return config.status();
  const int64_t spec_budget = spec.memory().host_budget_bytes();
  planner::Hardware hardware;
  std::string source;
  {
    absl::MutexLock lock(&mu_);
    const PlanMachine machine = MachineToPlanFor();
    hardware = PlanHardware(machine, spec_budget);
    source = machine.source;
  }
  if (request.gpu_bytes() > 0 || request.host_bytes() > 0) source = "the request";
  if (request.gpu_bytes() > 0) {
    hardware.gpu_bytes = request.gpu_bytes();
    hardware.cpu = false;  // the request names a GPU
  }
  if (request.host_bytes() > 0 && spec_budget <= 0) hardware.host_bytes = request.host_bytes();

  absl::StatusOr<planner::JobPlan> plan = planner::PlanJobSpec(PlannedSpec(spec, hardware), *config, hardware);
  if (!plan.ok()) return plan.status();
  v1::PlanResponse out;
  out.set_planned_gpu_bytes(hardware.gpu_bytes);
  out.set_planned_host_bytes(hardware.host_bytes);
  out.set_hardware(source);
  if (request.max_seq_len()) out.set_max_seq_len(planner::MaxSeqLen(planner::ShapeOf(*config), hardware));
  out.set_fits(plan->fits);
  out.set_message(plan->message);
  if (!plan->found) return out;  // no strategy: the message says by how much the best one misses
  const planner::MemoryStrategy& st = plan->strategy;
  planner::MemoryStrategyToProto(st, out.mutable_memory());
  out.set_device_resident(st.device_resident);
  out.set_attention_head_groups(static_cast<int32_t>(st.head_groups));
  out.set_optimizer_on_host(st.optimizer_on_host);
  out.set_gpu_peak_bytes(plan->prediction.gpu_peak_bytes);
  out.set_host_bytes(plan->prediction.host_bytes);
  for (const auto& [name, bytes] : plan->prediction.terms) {
    v1::PlanTerm* t = out.add_terms();
    t->set_name(name);
    t->set_bytes(bytes);
  }
  return out;
}

}  // namespace odyssey::server
