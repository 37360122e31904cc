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

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace odyssey::engine {

// Starts recording (CUDA activity too where `cuda`). FAILED_PRECONDITION if one is running.
absl::Status StartProfile(bool cuda, bool memory);
// Stops and writes the Chrome trace to `trace_path` (its folder must exist).
absl::Status StopProfile(const std::string& trace_path);

// Phase times without a trace: while they are recorded, every user scope (the ProfilePhase
// phases below and the kernels' RECORD_USER_SCOPE phases, on every thread, the autograd
// engine's included) is timed: on a GPU by a pair of CUDA events on the thread's current stream
// (the stream's time from the scope's start to its end, gaps included), else by the wall clock.
// Scopes nest, so a phase's time includes its inner phases'. Cheap beside a step (one pair of
// events a scope, nothing written), so the timed steps of a benchmark can carry them: where a
// long step's time goes without a multi-GB trace.
struct PhaseTime {
  std::string kind;    // the scope's name, each run of digits written '#' ("layer # backward")
  int64_t count = 0;   // scopes of this kind
  double seconds = 0;  // their summed time
};
// Thread safety: one recording at a time per process; start and stop from one thread (between
// steps), scopes from any thread.
// Starts recording (GPU time where `cuda`). FAILED_PRECONDITION if already recording.
// With `peak_bytes` (the device's peak allocated bytes since its last reset, e.g.
// ReadDeviceMemory(dev).peak_allocated), each scope also reads it at its start and end, and the
// recording names the scope in which the peak was reached (PhasePeak).
absl::Status StartPhaseTimes(bool cuda, std::function<int64_t()> peak_bytes = {});
// Stops (after synchronizing the device where `cuda`) and returns the kinds by time, longest
// first. FAILED_PRECONDITION if not recording; INTERNAL if a CUDA event failed.
absl::StatusOr<std::vector<PhaseTime>> StopPhaseTimes();
// Where the last recording's peak was reached: the innermost scope that was open when the
// allocated peak first reached its final value (a scope owns the peak when the counter rose
// between its start and its end and no scope inside it already claimed that value), with the
// scopes around it on its thread, outermost first ("backward > layers 26-27 backward > layer 27
// backward > dsa sparse attention backward"). Scopes on other threads (the autograd engine's
// workers) are not in the path. The path is empty where the peak rose outside every scope (its
// bytes then the reader's value at StopPhaseTimes) and both are where no reader was given.
// Valid after StopPhaseTimes, until the next StartPhaseTimes.
struct PeakScope {
  std::string path;    // "" where none
  int64_t bytes = 0;   // the peak's value as the owning scope read it at its end
};
PeakScope PhasePeak();
// The kind a scope's name counts under: each run of ASCII digits replaced by '#'.
std::string PhaseKind(const std::string& name);

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
