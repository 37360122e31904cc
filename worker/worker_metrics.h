// WorkerMetrics: the worker's Prometheus metrics (DESIGN.md section 6), on one registry that
// the worker's MetricsEndpoint serves. No per-job labels (jobs are high-cardinality). Names
// are the worker's own (odyssey_worker_*) where the controller exports a figure of the same
// kind for whole jobs (odyssey_tokens_total, odyssey_step_duration_seconds): one name, one meaning.
// Thread safety: prometheus-cpp metrics are thread-safe; the pointers never change.
#pragma once

#include <memory>

#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace odyssey::worker {

class WorkerMetrics {
 public:
  WorkerMetrics();
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  prometheus::Histogram* step_duration;  // odyssey_worker_step_duration_seconds (this rank's steps)
  prometheus::Counter* tokens;           // odyssey_worker_tokens_total (this rank's positions)
  prometheus::Counter* steps;            // odyssey_steps_total
  prometheus::Gauge* gpu_memory_peak;    // odyssey_gpu_memory_peak_bytes (0 on CPU)
  prometheus::Gauge* gpu_memory_capacity;  // odyssey_gpu_memory_capacity_bytes (0 on CPU)
  prometheus::Gauge* host_offload;       // odyssey_host_offload_bytes
  prometheus::Gauge* host_memory_peak;   // odyssey_host_memory_peak_bytes
  prometheus::Gauge* mfu;                // odyssey_model_flops_utilization_ratio (GPU only)
  prometheus::Gauge* connected;          // odyssey_worker_connected: 1 while attached
  prometheus::Gauge* busy;               // odyssey_worker_busy: 1 while a job runs
  prometheus::Counter* jobs_succeeded;   // odyssey_worker_jobs_total{result="succeeded"}
  prometheus::Counter* jobs_failed;      // ...{result="failed"}
  prometheus::Counter* jobs_cancelled;   // ...{result="cancelled"}
  prometheus::Counter* reconnects;       // odyssey_worker_reconnects_total
  // odyssey_worker_phase_seconds{phase}: the last timed step's seconds of each kind of phase
  // (spec.profile.phase_times; a phase includes the phases inside it).
  prometheus::Family<prometheus::Gauge>* phase_seconds;

 private:
  std::shared_ptr<prometheus::Registry> registry_;
};

}  // namespace odyssey::worker
