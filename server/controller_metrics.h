// ControllerMetrics: the controller's Prometheus families (DESIGN.md section 6 names) and their
// updates. The Controller decides when a figure changes (it holds the jobs and workers); this
// unit owns the names, labels and help texts, and the per-job series' lifetime.
//
// With a null registry every update is a no-op (a controller without /metrics).
// Per-job series (odyssey_job_*{job_id}, odyssey_rl_*{job_id}, odyssey_training_calls_waiting
// {job_id}) are created on first use and removed by RemoveJob when the job ends, so their
// cardinality is bounded by the running jobs. Their label is `job_id`, the job's number ("12" for
// jobs/12), never `job`: that is Prometheus' own target label. Every name means one thing:
// the workers' per-rank figures have names of their own (odyssey_worker_*).
//
// Thread safety: every method may be called from any thread (prometheus-cpp's families and
// metrics are thread-safe). The Controller calls most of them under its mutex,
// CountTrainingCall also without it.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace odyssey::server {

class ControllerMetrics {
 public:
  // Jobs by state, indexed by odyssey.v1.Job.State (0 = STATE_UNSPECIFIED, not exported).
  using JobCounts = std::array<int64_t, 6>;

  // Registers the families in `registry`; null = no metrics.
  explicit ControllerMetrics(prometheus::Registry* registry);
  ControllerMetrics(const ControllerMetrics&) = delete;
  ControllerMetrics& operator=(const ControllerMetrics&) = delete;

  // odyssey_jobs{state} for PENDING..CANCELLED, and odyssey_queue_depth (the PENDING count).
  void SetJobs(const JobCounts& by_state);
  // odyssey_workers{state="idle"|"busy"|"disconnected"}.
  void SetWorkers(int64_t idle, int64_t busy, int64_t disconnected);
  // odyssey_jobs_created_total (idempotent retries are not counted: the caller does not call).
  void JobCreated();
  // odyssey_job_restarts_total.
  void JobRestarted();
  // odyssey_rendezvous_retries_total: attempts run again because their ranks did not meet.
  void RendezvousRetried();
  // odyssey_tokens_total: tokens trained by all jobs, every rank's (rank 0's reports).
  void AddTokens(int64_t tokens);
  // odyssey_step_duration_seconds: one observation per job step (rank 0's).
  void ObserveStep(double seconds);
  // odyssey_job_loss{job_id}: an SFT job's last step loss, an RL session's last ForwardBackward
  // loss (the whole batch's).
  void SetLoss(const std::string& job, double loss);
  // odyssey_job_grad_norm{job_id} (before clipping) and odyssey_job_learning_rate{job_id} of the
  // job's last optimizer step.
  void SetOptimizerFigures(const std::string& job, double grad_norm, double lr);
  // odyssey_training_calls_total{method, code}: `code` as its upper-case name ("OK",
  // "INVALID_ARGUMENT", ...).
  void CountTrainingCall(const std::string& method, absl::StatusCode code);
  // `job` below is the job's name ("jobs/12"); the series carry job_id="12".
  // odyssey_rl_logprob_mismatch_mean{job_id} and _max{job_id}.
  void SetMismatch(const std::string& job, double mean, double max);
  // odyssey_rl_optimizer_step{job_id}.
  void SetOptimizerStep(const std::string& job, int64_t step);
  // odyssey_training_calls_waiting{job_id}: sequenced calls that arrived early and wait for their
  // turn (Controller::AwaitSequence).
  void SetWaitingCalls(const std::string& job, int64_t waiting);
  // Removes job `job`'s per-job series (those it has).
  void RemoveJob(const std::string& job);

  // The label set of job `job`'s series: {job_id: "12"} for "jobs/12".
  static prometheus::Labels JobLabels(const std::string& job);

 private:
  bool enabled() const { return tokens_ != nullptr; }

  std::array<prometheus::Gauge*, 6> jobs_by_state_ = {};
  prometheus::Gauge* queue_depth_ = nullptr;
  prometheus::Gauge* workers_idle_ = nullptr;
  prometheus::Gauge* workers_busy_ = nullptr;
  prometheus::Gauge* workers_disconnected_ = nullptr;
  prometheus::Counter* tokens_ = nullptr;
  prometheus::Histogram* step_duration_ = nullptr;
  prometheus::Counter* jobs_created_ = nullptr;
  prometheus::Counter* restarts_ = nullptr;
  prometheus::Counter* rendezvous_retries_ = nullptr;
  prometheus::Family<prometheus::Counter>* training_calls_ = nullptr;
  prometheus::Family<prometheus::Gauge>* mismatch_mean_ = nullptr;
  prometheus::Family<prometheus::Gauge>* mismatch_max_ = nullptr;
  prometheus::Family<prometheus::Gauge>* optimizer_step_ = nullptr;
  prometheus::Family<prometheus::Gauge>* waiting_calls_ = nullptr;
  prometheus::Family<prometheus::Gauge>* loss_ = nullptr;
  prometheus::Family<prometheus::Gauge>* grad_norm_ = nullptr;
  prometheus::Family<prometheus::Gauge>* learning_rate_ = nullptr;
};

}  // namespace odyssey::server
