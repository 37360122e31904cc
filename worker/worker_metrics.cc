#include "worker/worker_metrics.h"

namespace odyssey::worker {

WorkerMetrics::WorkerMetrics() : registry_(std::make_shared<prometheus::Registry>()) {
  auto& r = *registry_;
  step_duration = &prometheus::BuildHistogram()
                       .Name("odyssey_worker_step_duration_seconds")
                       .Help("Wall time of one training step on this worker (its rank; RL sessions: compute "
                             "time per optimizer step); whole jobs' steps are the controller's "
                             "odyssey_step_duration_seconds")
                       .Register(r)
                       .Add({}, prometheus::Histogram::BucketBoundaries{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
                                                                        5, 10, 30, 60, 120, 300, 600, 1800});
  tokens = &prometheus::BuildCounter()
                .Name("odyssey_worker_tokens_total")
                .Help("Token positions trained on this worker (its own rank's share); all ranks of all jobs "
                      "are the controller's odyssey_tokens_total")
                .Register(r)
                .Add({});
  steps = &prometheus::BuildCounter().Name("odyssey_steps_total").Help("Training steps run").Register(r).Add({});
  gpu_memory_peak = &prometheus::BuildGauge()
                         .Name("odyssey_gpu_memory_peak_bytes")
                         .Help("Peak GPU memory allocated by the current job (0 on a CPU worker)")
                         .Register(r)
                         .Add({});
  gpu_memory_capacity = &prometheus::BuildGauge()
                             .Name("odyssey_gpu_memory_capacity_bytes")
                             .Help("Memory of the worker's GPU, as the driver reports it (0 on a CPU worker)")
                             .Register(r)
                             .Add({});
  host_offload = &prometheus::BuildGauge()
                      .Name("odyssey_host_offload_bytes")
                      .Help("Pinned host memory held by the current job's offload pool")
                      .Register(r)
                      .Add({});
  host_memory_peak = &prometheus::BuildGauge()
                          .Name("odyssey_host_memory_peak_bytes")
                          .Help("Peak resident host memory of the worker process")
                          .Register(r)
                          .Add({});
  mfu = &prometheus::BuildGauge()
             .Name("odyssey_model_flops_utilization_ratio")
             .Help("Model FLOPs of the last step over the device's peak (GPU workers)")
             .Register(r)
             .Add({});
  connected = &prometheus::BuildGauge()
                   .Name("odyssey_worker_connected")
                   .Help("1 while the worker is attached to the controller")
                   .Register(r)
                   .Add({});
  busy = &prometheus::BuildGauge().Name("odyssey_worker_busy").Help("1 while a job runs").Register(r).Add({});
  auto& jobs = prometheus::BuildCounter().Name("odyssey_worker_jobs_total").Help("Job runs ended, by result").Register(r);
  jobs_succeeded = &jobs.Add({{"result", "succeeded"}});
  jobs_failed = &jobs.Add({{"result", "failed"}});
  jobs_cancelled = &jobs.Add({{"result", "cancelled"}});
  phase_seconds = &prometheus::BuildGauge()
                       .Name("odyssey_worker_phase_seconds")
                       .Help("Seconds of each kind of phase in the last step timed (spec.profile.phase_times: "
                             "each layer's forward, recompute and backward, loss, optimizer, the kernels' "
                             "phases; a phase includes the phases inside it)")
                       .Register(r);
  reconnects = &prometheus::BuildCounter()
                    .Name("odyssey_worker_reconnects_total")
                    .Help("Attach streams opened after the first")
                    .Register(r)
                    .Add({});
}

}  // namespace odyssey::worker
