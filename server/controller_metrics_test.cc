// ControllerMetrics (controller_metrics.h): the families' names and labels as /metrics shows
// them, the per-job series' removal, and no metrics without a registry.
#include "server/controller_metrics.h"

#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/text_serializer.h"

namespace odyssey::server {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

class ControllerMetricsTest : public ::testing::Test {
 protected:
  std::string Text() { return prometheus::TextSerializer().Serialize(registry_->Collect()); }

  std::shared_ptr<prometheus::Registry> registry_ = std::make_shared<prometheus::Registry>();
  ControllerMetrics metrics_{registry_.get()};
};

TEST_F(ControllerMetricsTest, JobsAndWorkersByState) {
  metrics_.SetJobs({0, 3, 2, 1, 4, 5});
  metrics_.SetWorkers(1, 2, 3);
  const std::string m = Text();
  EXPECT_THAT(m, HasSubstr("odyssey_jobs{state=\"pending\"} 3"));
  EXPECT_THAT(m, HasSubstr("odyssey_jobs{state=\"running\"} 2"));
  EXPECT_THAT(m, HasSubstr("odyssey_jobs{state=\"succeeded\"} 1"));
  EXPECT_THAT(m, HasSubstr("odyssey_jobs{state=\"failed\"} 4"));
  EXPECT_THAT(m, HasSubstr("odyssey_jobs{state=\"cancelled\"} 5"));
  EXPECT_THAT(m, Not(HasSubstr("state_unspecified")));
  EXPECT_THAT(m, HasSubstr("odyssey_queue_depth 3"));
  EXPECT_THAT(m, HasSubstr("odyssey_workers{state=\"idle\"} 1"));
  EXPECT_THAT(m, HasSubstr("odyssey_workers{state=\"busy\"} 2"));
  EXPECT_THAT(m, HasSubstr("odyssey_workers{state=\"disconnected\"} 3"));
}

TEST_F(ControllerMetricsTest, CountersAndTheStepHistogram) {
  metrics_.JobCreated();
  metrics_.JobCreated();
  metrics_.JobRestarted();
  metrics_.RendezvousRetried();
  metrics_.RendezvousRetried();
  metrics_.AddTokens(100);
  metrics_.AddTokens(28);
  metrics_.ObserveStep(0.2);
  const std::string m = Text();
  EXPECT_THAT(m, HasSubstr("odyssey_jobs_created_total 2"));
  EXPECT_THAT(m, HasSubstr("odyssey_job_restarts_total 1"));
  EXPECT_THAT(m, HasSubstr("odyssey_rendezvous_retries_total 2"));
  EXPECT_THAT(m, HasSubstr("odyssey_tokens_total 128"));
  EXPECT_THAT(m, HasSubstr("odyssey_step_duration_seconds_count 1"));
  EXPECT_THAT(m, HasSubstr("odyssey_step_duration_seconds_bucket{le=\"0.3\"} 1"));
  EXPECT_THAT(m, HasSubstr("odyssey_step_duration_seconds_bucket{le=\"0.1\"} 0"));
}

// Codes by their upper-case names, one series per (method, code).
TEST_F(ControllerMetricsTest, TrainingCallsByMethodAndCode) {
  metrics_.CountTrainingCall("OptimStep", absl::StatusCode::kOk);
  metrics_.CountTrainingCall("OptimStep", absl::StatusCode::kOk);
  metrics_.CountTrainingCall("Forward", absl::StatusCode::kInvalidArgument);
  const std::string m = Text();
  EXPECT_THAT(m, HasSubstr("odyssey_training_calls_total{code=\"OK\",method=\"OptimStep\"} 2"));
  EXPECT_THAT(m, HasSubstr("odyssey_training_calls_total{code=\"INVALID_ARGUMENT\",method=\"Forward\"} 1"));
}

// The per-job series exist once set and are gone after RemoveJob; other jobs' stay. Their label
// is job_id (the job's number): never `job`, Prometheus' own target label.
TEST_F(ControllerMetricsTest, PerJobSeriesAreRemovedWithTheJob) {
  metrics_.SetMismatch("jobs/1", 0.125, 0.5);
  metrics_.SetOptimizerStep("jobs/1", 7);
  metrics_.SetOptimizerStep("jobs/2", 3);
  metrics_.SetWaitingCalls("jobs/1", 2);
  metrics_.SetLoss("jobs/1", 1.5);
  metrics_.SetOptimizerFigures("jobs/1", 0.25, 0.003);
  metrics_.SetLoss("jobs/2", 4.5);
  std::string m = Text();
  EXPECT_THAT(m, HasSubstr("odyssey_training_calls_waiting{job_id=\"1\"} 2"));
  EXPECT_THAT(m, HasSubstr("odyssey_rl_logprob_mismatch_mean{job_id=\"1\"} 0.125"));
  EXPECT_THAT(m, HasSubstr("odyssey_rl_logprob_mismatch_max{job_id=\"1\"} 0.5"));
  EXPECT_THAT(m, HasSubstr("odyssey_rl_optimizer_step{job_id=\"1\"} 7"));
  EXPECT_THAT(m, HasSubstr("odyssey_job_loss{job_id=\"1\"} 1.5"));
  EXPECT_THAT(m, HasSubstr("odyssey_job_grad_norm{job_id=\"1\"} 0.25"));
  EXPECT_THAT(m, HasSubstr("odyssey_job_learning_rate{job_id=\"1\"} 0.003"));
  EXPECT_THAT(m, Not(HasSubstr("job=")));
  metrics_.RemoveJob("jobs/1");
  metrics_.RemoveJob("jobs/9");  // never had series: nothing to do
  m = Text();
  EXPECT_THAT(m, Not(HasSubstr("job_id=\"1\"")));
  EXPECT_THAT(m, HasSubstr("odyssey_rl_optimizer_step{job_id=\"2\"} 3"));
  EXPECT_THAT(m, HasSubstr("odyssey_job_loss{job_id=\"2\"} 4.5"));
}

TEST(ControllerMetricsWithoutRegistryTest, EveryUpdateIsANoOp) {
  ControllerMetrics metrics(nullptr);
  metrics.SetJobs({0, 1, 1, 1, 1, 1});
  metrics.SetWorkers(1, 1, 1);
  metrics.JobCreated();
  metrics.JobRestarted();
  metrics.AddTokens(1);
  metrics.ObserveStep(1);
  metrics.CountTrainingCall("Forward", absl::StatusCode::kOk);
  metrics.SetMismatch("jobs/1", 1, 1);
  metrics.SetOptimizerStep("jobs/1", 1);
  metrics.SetLoss("jobs/1", 1);
  metrics.SetOptimizerFigures("jobs/1", 1, 1);
  metrics.RemoveJob("jobs/1");
}

}  // namespace
}  // namespace odyssey::server
