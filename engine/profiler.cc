#include "engine/profiler.h"

#include <atomic>
#include <set>

#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include "absl/strings/str_cat.h"

namespace odyssey::engine {
namespace {
std::atomic<bool> g_running{false};
}  // namespace

absl::Status StartProfile(bool cuda, bool memory) {
  if (g_running.exchange(true)) return absl::FailedPreconditionError("a profile is already being recorded");
  using torch::profiler::impl::ActivityType;
  const torch::profiler::impl::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO,
                                                     /*report_input_shapes=*/false, /*profile_memory=*/memory);
  std::set<ActivityType> activities = {ActivityType::CPU};
  if (cuda) activities.insert(ActivityType::CUDA);
  try {
    torch::autograd::profiler::prepareProfiler(config, activities);
    torch::autograd::profiler::enableProfiler(config, activities);
  } catch (const std::exception& e) {
    g_running = false;
    return absl::InternalError(absl::StrCat("profiler: cannot start: ", e.what()));
  }
  return absl::OkStatus();
}

absl::Status StopProfile(const std::string& trace_path) {
  if (!g_running) return absl::FailedPreconditionError("no profile is being recorded");
  try {
    std::unique_ptr<torch::autograd::profiler::ProfilerResult> result = torch::autograd::profiler::disableProfiler();
    g_running = false;
    result->save(trace_path);
  } catch (const std::exception& e) {
    g_running = false;
    return absl::InternalError(absl::StrCat("profiler: cannot write ", trace_path, ": ", e.what()));
  }
  return absl::OkStatus();
}

ProfilePhase::ProfilePhase(const std::string& name) {
  auto* guard = new at::RecordFunction(at::RecordScope::USER_SCOPE);
  if (guard->isActive()) guard->before(name);
  guard_ = guard;
}

ProfilePhase::~ProfilePhase() { delete static_cast<at::RecordFunction*>(guard_); }

}  // namespace odyssey::engine
