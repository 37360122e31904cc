#include "engine/profiler.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <set>
#include <utility>

#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#ifdef ODYSSEY_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"

namespace odyssey::engine {
namespace {
std::atomic<bool> g_running{false};

// The phase timer. One for the process, never freed: a scope opened before StopPhaseTimes may
// still end after it (its end callback then finds the timer stopped and drops the span).
using Clock = std::chrono::steady_clock;
struct Span {
  std::string name;
  double wall = 0;  // seconds, where no events were recorded
  void* start = nullptr;  // cudaEvent_t
  void* end = nullptr;
};
struct PhaseTimer {
  absl::Mutex mu;
  bool running ABSL_GUARDED_BY(mu) = false;
  std::vector<Span> spans ABSL_GUARDED_BY(mu);
  std::string error ABSL_GUARDED_BY(mu);  // the first CUDA call that failed
  // The peak reader of the recording (null: no peak attribution). Each scope keeps the one it
  // started under, so a scope that ends after StopPhaseTimes still pops what it pushed.
  std::shared_ptr<const std::function<int64_t()>> peak_bytes ABSL_GUARDED_BY(mu);
  PeakScope peak ABSL_GUARDED_BY(mu);
  // Set by StartPhaseTimes before its callback is added, read by the callbacks (peak_on: whether
  // peak_bytes is set, so that a recording without a reader takes no lock at a scope's start).
  std::atomic<bool> cuda{false}, peak_on{false};
  at::CallbackHandle handle = 0;  // StartPhaseTimes / StopPhaseTimes only
};
PhaseTimer& Timer() {
  static auto* timer = new PhaseTimer;
  return *timer;
}

void DestroyEvent(void* e) {
#ifdef ODYSSEY_WITH_CUDA
  if (e != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(e));
#else
  (void)e;
#endif
}

// An event recorded now on the calling thread's current stream; null (and the timer's error
// set) where CUDA fails.
void* RecordEvent(PhaseTimer& timer) {
#ifdef ODYSSEY_WITH_CUDA
  cudaEvent_t e = nullptr;
  cudaError_t err = cudaEventCreate(&e);
  if (err == cudaSuccess) err = cudaEventRecord(e, c10::cuda::getCurrentCUDAStream().stream());
  if (err == cudaSuccess) return e;
  if (e != nullptr) cudaEventDestroy(e);
  absl::MutexLock lock(&timer.mu);
  if (timer.error.empty()) timer.error = absl::StrCat("cudaEventRecord: ", cudaGetErrorString(err));
#else
  (void)timer;
#endif
  return nullptr;
}

struct SpanContext : at::ObserverContext {
  std::string name;
  Clock::time_point t0;
  void* start = nullptr;
  std::shared_ptr<const std::function<int64_t()>> peak_bytes;  // the recording's, at the start
  int64_t peak0 = 0;  // its value at the start
  ~SpanContext() override { DestroyEvent(start); }
};

// The open scopes of this thread, outermost first (for the peak's path).
thread_local std::vector<std::string> t_open;

std::unique_ptr<at::ObserverContext> OnScopeStart(const at::RecordFunction& fn) {
  PhaseTimer& timer = Timer();
  auto c = std::make_unique<SpanContext>();
  c->name = fn.name();
  if (timer.peak_on) {
    absl::MutexLock lock(&timer.mu);
    c->peak_bytes = timer.peak_bytes;
  }
  if (c->peak_bytes) {
    c->peak0 = (*c->peak_bytes)();
    t_open.push_back(c->name);
  }
  c->t0 = Clock::now();
  if (timer.cuda) c->start = RecordEvent(timer);
  return c;
}

void OnScopeEnd(const at::RecordFunction&, at::ObserverContext* ctx) {
  PhaseTimer& timer = Timer();
  auto* c = static_cast<SpanContext*>(ctx);
  if (c->peak_bytes) {
    const int64_t now = (*c->peak_bytes)();
    const bool rose = now > c->peak0;
    std::string path = rose ? absl::StrJoin(t_open, " > ") : std::string();  // before this scope leaves it
    if (!t_open.empty()) t_open.pop_back();
    if (rose) {
      absl::MutexLock lock(&timer.mu);
      if (timer.running && now > timer.peak.bytes) timer.peak = PeakScope{std::move(path), now};
    }
  }
  Span s;
  s.wall = std::chrono::duration<double>(Clock::now() - c->t0).count();
  if (c->start != nullptr) {
    s.end = RecordEvent(timer);
    if (s.end != nullptr) std::swap(s.start, c->start);
  }
  s.name = std::move(c->name);
  absl::MutexLock lock(&timer.mu);
  if (!timer.running) {
    DestroyEvent(s.start);
    DestroyEvent(s.end);
    return;
  }
  timer.spans.push_back(std::move(s));
}
}  // namespace

std::string PhaseKind(const std::string& name) {
  std::string kind;
  kind.reserve(name.size());
  for (size_t i = 0; i < name.size(); ++i) {
    const bool digit = name[i] >= '0' && name[i] <= '9';
    if (!digit) {
      kind.push_back(name[i]);
    } else if (i == 0 || name[i - 1] < '0' || name[i - 1] > '9') {
      kind.push_back('#');
    }
  }
  return kind;
}

absl::Status StartPhaseTimes(bool cuda, std::function<int64_t()> peak_bytes) {
  PhaseTimer& timer = Timer();
  {
    absl::MutexLock lock(&timer.mu);
    if (timer.running) return absl::FailedPreconditionError("phase times are already being recorded");
#ifndef ODYSSEY_WITH_CUDA
    if (cuda) return absl::FailedPreconditionError("phase times on a GPU: this build has no CUDA");
#endif
    timer.running = true;
    timer.cuda = cuda;
    timer.spans.clear();
    timer.error.clear();
    timer.peak = PeakScope{};
    timer.peak_bytes =
        peak_bytes ? std::make_shared<const std::function<int64_t()>>(std::move(peak_bytes)) : nullptr;
    timer.peak_on = timer.peak_bytes != nullptr;
  }
  at::RecordFunctionCallback cb(&OnScopeStart, &OnScopeEnd);
  cb.scopes({at::RecordScope::USER_SCOPE});
  timer.handle = at::addGlobalCallback(cb);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<PhaseTime>> StopPhaseTimes() {
  PhaseTimer& timer = Timer();
  std::vector<Span> spans;
  std::string error;
  bool cuda = false;
  std::shared_ptr<const std::function<int64_t()>> reader;
  {
    absl::MutexLock lock(&timer.mu);
    if (!timer.running) return absl::FailedPreconditionError("no phase times are being recorded");
    timer.running = false;
    reader.swap(timer.peak_bytes);
    timer.peak_on = false;
    spans.swap(timer.spans);
    error.swap(timer.error);
    cuda = timer.cuda;
  }
  at::removeCallback(timer.handle);
  timer.handle = 0;
  if (reader) {
    // A peak above every scope's claim rose outside them all.
    const int64_t final_peak = (*reader)();
    absl::MutexLock lock(&timer.mu);
    if (final_peak > timer.peak.bytes) timer.peak = PeakScope{"", final_peak};
  }
#ifndef ODYSSEY_WITH_CUDA
  (void)cuda;  // StartPhaseTimes refused a GPU timer
#else
  if (cuda && error.empty()) {
    if (cudaError_t err = cudaDeviceSynchronize(); err != cudaSuccess)
      error = absl::StrCat("cudaDeviceSynchronize: ", cudaGetErrorString(err));
  }
#endif
  std::map<std::string, PhaseTime> by_kind;
  for (Span& s : spans) {
    double seconds = s.wall;
#ifdef ODYSSEY_WITH_CUDA
    if (cuda && error.empty()) {
      float ms = 0;
      if (s.start == nullptr || s.end == nullptr) {
        error = absl::StrCat("phase \"", s.name, "\": no CUDA events were recorded");
      } else if (cudaError_t err = cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(s.start),
                                                        static_cast<cudaEvent_t>(s.end));
                 err != cudaSuccess) {
        error = absl::StrCat("cudaEventElapsedTime: ", cudaGetErrorString(err));
      }
      seconds = ms / 1e3;
    }
#endif
    DestroyEvent(s.start);
    DestroyEvent(s.end);
    PhaseTime& t = by_kind[PhaseKind(s.name)];
    t.count += 1;
    t.seconds += seconds;
  }
  if (!error.empty()) return absl::InternalError(absl::StrCat("phase times: ", error));
  std::vector<PhaseTime> out;
  out.reserve(by_kind.size());
  for (auto& [kind, t] : by_kind) {
    t.kind = kind;
    out.push_back(std::move(t));
  }
  std::stable_sort(out.begin(), out.end(), [](const PhaseTime& a, const PhaseTime& b) { return a.seconds > b.seconds; });
  return out;
}

PeakScope PhasePeak() {
  PhaseTimer& timer = Timer();
  absl::MutexLock lock(&timer.mu);
  return timer.peak;
}

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
