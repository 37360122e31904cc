#include "server/controller_metrics.h"

#include <algorithm>
#include <cctype>

#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

#include "odyssey/v1/odyssey.pb.h"

namespace odyssey::server {

namespace v1 = odyssey::v1;

ControllerMetrics::ControllerMetrics(prometheus::Registry* registry) {
  if (!registry) return;
  auto& jobs = prometheus::BuildGauge().Name("odyssey_jobs").Help("Jobs by state").Register(*registry);
  for (int s = v1::Job::PENDING; s <= v1::Job::CANCELLED; ++s) {
    std::string label = v1::Job::State_Name(static_cast<v1::Job::State>(s));
    std::transform(label.begin(), label.end(), label.begin(), ::tolower);
    jobs_by_state_[static_cast<size_t>(s)] = &jobs.Add({{"state", label}});
  }
  queue_depth_ = &prometheus::BuildGauge()
                      .Name("odyssey_queue_depth")
                      .Help("Jobs waiting for workers (PENDING)")
                      .Register(*registry)
                      .Add({});
  auto& workers = prometheus::BuildGauge().Name("odyssey_workers").Help("Workers by state").Register(*registry);
  workers_idle_ = &workers.Add({{"state", "idle"}});
  workers_busy_ = &workers.Add({{"state", "busy"}});
  workers_disconnected_ = &workers.Add({{"state", "disconnected"}});
  tokens_ = &prometheus::BuildCounter()
                 .Name("odyssey_tokens_total")
                 .Help("Tokens trained by all jobs (every rank's positions), as rank 0 of each job reports them; "
                       "a worker's own share is odyssey_worker_tokens_total")
                 .Register(*registry)
                 .Add({});
  step_duration_ = &prometheus::BuildHistogram()
                        .Name("odyssey_step_duration_seconds")
                        .Help("Training step wall time, one observation per job step as rank 0 reports it; a "
                              "worker's own steps are odyssey_worker_step_duration_seconds")
                        .Register(*registry)
                        .Add({}, prometheus::Histogram::BucketBoundaries{0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100,
                                                                         300, 1000, 3000});
  jobs_created_ = &prometheus::BuildCounter()
                       .Name("odyssey_jobs_created_total")
                       .Help("Jobs created (idempotent retries not counted)")
                       .Register(*registry)
                       .Add({});
  restarts_ = &prometheus::BuildCounter()
                   .Name("odyssey_job_restarts_total")
                   .Help("Jobs put back in the queue after losing a worker")
                   .Register(*registry)
                   .Add({});
  rendezvous_retries_ = &prometheus::BuildCounter()
                             .Name("odyssey_rendezvous_retries_total")
                             .Help("Job attempts run again on another port because their ranks did not meet at "
                                   "the rendezvous (its port taken, a rank late); not restarts")
                             .Register(*registry)
                             .Add({});
  training_calls_ = &prometheus::BuildCounter()
                         .Name("odyssey_training_calls_total")
                         .Help("TrainingService calls by method and final status code")
                         .Register(*registry);
  mismatch_mean_ = &prometheus::BuildGauge()
                        .Name("odyssey_rl_logprob_mismatch_mean")
                        .Help("Mean |trainer - sampler| logprob over the weighted tokens of the RL session's "
                              "last ForwardBackward that carried sampler logprobs (nats)")
                        .Register(*registry);
  mismatch_max_ = &prometheus::BuildGauge()
                       .Name("odyssey_rl_logprob_mismatch_max")
                       .Help("Max |trainer - sampler| logprob over the same tokens (nats)")
                       .Register(*registry);
  optimizer_step_ = &prometheus::BuildGauge()
                         .Name("odyssey_rl_optimizer_step")
                         .Help("Optimizer steps completed by the RL session (after OptimStep / LoadCheckpoint)")
                         .Register(*registry);
  waiting_calls_ = &prometheus::BuildGauge()
                        .Name("odyssey_training_calls_waiting")
                        .Help("Sequenced TrainingService calls of the session waiting for an earlier sequence")
                        .Register(*registry);
  loss_ = &prometheus::BuildGauge()
               .Name("odyssey_job_loss")
               .Help("Loss of the job's last step (SFT: rank 0's report; RL session: its last ForwardBackward's "
                     "batch loss), nats per target token")
               .Register(*registry);
  grad_norm_ = &prometheus::BuildGauge()
                    .Name("odyssey_job_grad_norm")
                    .Help("Global gradient norm of the job's last optimizer step, before clipping")
                    .Register(*registry);
  learning_rate_ = &prometheus::BuildGauge()
                        .Name("odyssey_job_learning_rate")
                        .Help("Learning rate of the job's last optimizer step (SFT: the schedule's; RL: the "
                              "OptimStep's)")
                        .Register(*registry);
}

prometheus::Labels ControllerMetrics::JobLabels(const std::string& job) {
  constexpr absl::string_view kPrefix = "jobs/";
  absl::string_view id = job;
  if (absl::StartsWith(id, kPrefix)) id.remove_prefix(kPrefix.size());
  return {{"job_id", std::string(id)}};
}

void ControllerMetrics::SetJobs(const JobCounts& by_state) {
  if (!enabled()) return;
  for (int s = v1::Job::PENDING; s <= v1::Job::CANCELLED; ++s) {
    jobs_by_state_[static_cast<size_t>(s)]->Set(static_cast<double>(by_state[static_cast<size_t>(s)]));
  }
  queue_depth_->Set(static_cast<double>(by_state[v1::Job::PENDING]));
}

void ControllerMetrics::SetWorkers(int64_t idle, int64_t busy, int64_t disconnected) {
  if (!enabled()) return;
  workers_idle_->Set(static_cast<double>(idle));
  workers_busy_->Set(static_cast<double>(busy));
  workers_disconnected_->Set(static_cast<double>(disconnected));
}

void ControllerMetrics::JobCreated() {
  if (enabled()) jobs_created_->Increment();
}

void ControllerMetrics::JobRestarted() {
  if (enabled()) restarts_->Increment();
}

void ControllerMetrics::RendezvousRetried() {
  if (enabled()) rendezvous_retries_->Increment();
}

void ControllerMetrics::AddTokens(int64_t tokens) {
  if (enabled()) tokens_->Increment(static_cast<double>(tokens));
}

void ControllerMetrics::ObserveStep(double seconds) {
  if (enabled()) step_duration_->Observe(seconds);
}

void ControllerMetrics::CountTrainingCall(const std::string& method, absl::StatusCode code) {
  if (!enabled()) return;
  std::string name = absl::StatusCodeToString(code);
  std::transform(name.begin(), name.end(), name.begin(), ::toupper);
  training_calls_->Add({{"method", method}, {"code", name}}).Increment();
}

void ControllerMetrics::SetLoss(const std::string& job, double loss) {
  if (enabled()) loss_->Add(JobLabels(job)).Set(loss);
}

void ControllerMetrics::SetOptimizerFigures(const std::string& job, double grad_norm, double lr) {
  if (!enabled()) return;
  grad_norm_->Add(JobLabels(job)).Set(grad_norm);
  learning_rate_->Add(JobLabels(job)).Set(lr);
}

void ControllerMetrics::SetMismatch(const std::string& job, double mean, double max) {
  if (!enabled()) return;
  mismatch_mean_->Add(JobLabels(job)).Set(mean);
  mismatch_max_->Add(JobLabels(job)).Set(max);
}

void ControllerMetrics::SetOptimizerStep(const std::string& job, int64_t step) {
  if (enabled()) optimizer_step_->Add(JobLabels(job)).Set(static_cast<double>(step));
}

void ControllerMetrics::SetWaitingCalls(const std::string& job, int64_t waiting) {
  if (enabled()) waiting_calls_->Add(JobLabels(job)).Set(static_cast<double>(waiting));
}

void ControllerMetrics::RemoveJob(const std::string& job) {
  if (!enabled()) return;
  const prometheus::Labels labels = JobLabels(job);
  for (auto* family : {mismatch_mean_, mismatch_max_, optimizer_step_, waiting_calls_, loss_, grad_norm_,
                       learning_rate_}) {
    if (family->Has(labels)) family->Remove(&family->Add(labels));
  }
}

}  // namespace odyssey::server
