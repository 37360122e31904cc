#include "server/controller_metrics.h"

#include <algorithm>
#include <cctype>

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
                 .Help("Tokens trained, as reported by rank 0 of each job")
                 .Register(*registry)
                 .Add({});
  step_duration_ = &prometheus::BuildHistogram()
                        .Name("odyssey_step_duration_seconds")
                        .Help("Training step wall time, as reported by rank 0 of each job")
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

void ControllerMetrics::SetMismatch(const std::string& job, double mean, double max) {
  if (!enabled()) return;
  mismatch_mean_->Add({{"job", job}}).Set(mean);
  mismatch_max_->Add({{"job", job}}).Set(max);
}

void ControllerMetrics::SetOptimizerStep(const std::string& job, int64_t step) {
  if (enabled()) optimizer_step_->Add({{"job", job}}).Set(static_cast<double>(step));
}

void ControllerMetrics::SetWaitingCalls(const std::string& job, int64_t waiting) {
  if (enabled()) waiting_calls_->Add({{"job", job}}).Set(static_cast<double>(waiting));
}

void ControllerMetrics::RemoveJob(const std::string& job) {
  if (!enabled()) return;
  for (auto* family : {mismatch_mean_, mismatch_max_, optimizer_step_, waiting_calls_}) {
    if (family->Has({{"job", job}})) family->Remove(&family->Add({{"job", job}}));
  }
}

}  // namespace odyssey::server
