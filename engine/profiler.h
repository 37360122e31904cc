// The profiler built into odyssey: one training step recorded by libtorch's Kineto profiler
// (CPU ops, CUDA kernels and copies, and with memory on, every allocation with the allocator's
// totals after it), written as a Chrome trace (chrome://tracing, Perfetto). The engine marks its
// phases with user scopes that the trace shows on the CPU and, mapped onto the kernels they
// launched, on the GPU timeline: "layer N forward", "layer N recompute", "layer N backward" (or
// "layers A-B ..." per checkpoint group), "loss", "backward", "optimizer". bench/profile_report.py
// turns a trace into per-phase times, kernel time by kind, the memory timeline and its peak's
// phase, and a PNG plot.
//
// odyssey-bench --profile DIR records one more step after its timed ones. Thread safety: the profiler follows
// the thread that starts it (the training thread); one at a time per process.
#pragma once

#include <string>

#include "absl/status/status.h"

namespace odyssey::engine {

// Starts recording (CUDA activity too where `cuda`). FAILED_PRECONDITION if one is running.
absl::Status StartProfile(bool cuda, bool memory);
// Stops and writes the Chrome trace to `trace_path` (its folder must exist).
absl::Status StopProfile(const std::string& trace_path);

// A phase of the step, named in the trace while the object lives (a user scope; free when no
// profiler runs beyond building the name).
class ProfilePhase {
 public:
  explicit ProfilePhase(const std::string& name);
  ~ProfilePhase();
  ProfilePhase(const ProfilePhase&) = delete;
  ProfilePhase& operator=(const ProfilePhase&) = delete;

 private:
  void* guard_;  // at::RecordFunction, kept out of this header
};

}  // namespace odyssey::engine
