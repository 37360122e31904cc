// Planning (planning.cc): CreateJob's memory check and PlannerService.Plan over the attached
// workers' GPUs.
#include "server/controller.h"

#include <memory>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/testing/controller_fixture.h"

namespace odyssey::server {
namespace {

namespace v1 = odyssey::v1;
using ::testing::HasSubstr;
using testing::ControllerTest;
using testing::FakeConnection;
using testing::kAnon;

// CreateJob runs the planner before anything is stored or allocated: a 3B model at 8M tokens
// fits no H200 (the machine assumed while no worker is attached), nor an attached 80 GB GPU;
// 64K fits.
TEST_F(ControllerTest, PlannerRefusesJobsThatCannotFit) {
  v1::CreateJobRequest big = Request(1);
  big.mutable_spec()->mutable_model()->set_name("llama-3.2-3b");
  big.mutable_spec()->mutable_data()->set_seq_len(int64_t{8} << 20);
  auto r = controller_->CreateJob(big, kAnon);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("spec.data.seq_len: does not fit: 8388608 tokens"), std::string::npos)
      << r.status();
  EXPECT_NE(r.status().message().find(" by "), std::string::npos) << r.status();
  EXPECT_TRUE(controller_->ListJobs(v1::ListJobsRequest(), kAnon)->jobs().empty());

  v1::CreateJobRequest fits = big;
  fits.mutable_spec()->mutable_data()->set_seq_len(65536);
  EXPECT_TRUE(controller_->CreateJob(fits, kAnon).ok());

  v1::WorkerCapabilities caps;
  caps.set_worker_id("gpu-0");
  caps.set_device("cuda:0");
  caps.set_device_memory_bytes(int64_t{80} << 30);
  caps.set_host_memory_bytes(int64_t{64} << 30);
  ASSERT_TRUE(controller_->AttachWorker(caps, "127.0.0.1", std::make_shared<FakeConnection>()).ok());
  v1::CreateJobRequest mid = big;
  mid.mutable_spec()->mutable_data()->set_seq_len(int64_t{1} << 20);  // fits an H200, not 80 GB
  r = controller_->CreateJob(mid, kAnon);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
}

// PlannerService.Plan: the same verdicts as CreateJob's check, with the strategy and its
// peaks, on the hardware it names; the spec's memory fields win over the planner's choice;
// nothing is created.
TEST_F(ControllerTest, PlanAnswersWhatCreateJobWouldDecide) {
  constexpr int64_t kH200GpuBytes = int64_t{136} << 30;  // planner::Hardware's default
  v1::PlanRequest req;
  *req.mutable_spec() = Request(1).spec();
  req.mutable_spec()->mutable_model()->set_name("llama-3.2-3b");
  req.mutable_spec()->mutable_data()->set_seq_len(65536);
  req.set_max_seq_len(true);
  auto p = controller_->Plan(req);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->fits()) << p->message();
  EXPECT_EQ(p->memory().recompute(), "layer");
  EXPECT_EQ(p->hardware(), "an H200 host (no GPU worker is attached)");
  EXPECT_EQ(p->planned_gpu_bytes(), kH200GpuBytes);
  EXPECT_GT(p->gpu_peak_bytes(), int64_t{20} << 30);
  EXPECT_LE(p->gpu_peak_bytes(), p->planned_gpu_bytes());
  int64_t sum = 0;
  for (const auto& t : p->terms()) sum += t.bytes();
  EXPECT_EQ(sum, p->gpu_peak_bytes());  // the terms of the peak phase add up to it
  EXPECT_GE(p->max_seq_len(), int64_t{1} << 20);  // the planner's longest for 3B on an H200: 1.49M

  // The spec's memory fields: that strategy, whether or not it fits (no recompute at 256K: every
  // layer's activations, ~9 GB each, stay until backward).
  req.mutable_spec()->mutable_data()->set_seq_len(262144);
  v1::MemorySpec* m = req.mutable_spec()->mutable_memory();
  m->set_recompute("none");
  m->set_offload("off");
  m->set_mlp_tile_tokens(4096);
  m->set_loss_tile_tokens(2048);
  p = controller_->Plan(req);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_FALSE(p->fits());
  EXPECT_EQ(p->memory().recompute(), "none");
  EXPECT_EQ(p->memory().mlp_tile_tokens(), 4096);
  EXPECT_THAT(p->message(), HasSubstr("the strategy needs"));
  EXPECT_GT(p->gpu_peak_bytes(), p->planned_gpu_bytes());

  // One field set: the planner's choice for the rest.
  req.mutable_spec()->mutable_data()->set_seq_len(65536);
  req.mutable_spec()->clear_memory();
  req.mutable_spec()->mutable_memory()->set_loss_tile_tokens(1024);
  p = controller_->Plan(req);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->fits());
  EXPECT_EQ(p->memory().recompute(), "layer");
  EXPECT_EQ(p->memory().loss_tile_tokens(), 1024);

  // Too long for any strategy: not an error, fits = false with the planner's message.
  req.mutable_spec()->clear_memory();
  req.mutable_spec()->mutable_data()->set_seq_len(int64_t{8} << 20);
  p = controller_->Plan(req);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_FALSE(p->fits());
  EXPECT_THAT(p->message(), HasSubstr("does not fit: 8388608 tokens"));

  // An attached GPU worker is the machine; the request's bytes override it.
  v1::WorkerCapabilities caps;
  caps.set_worker_id("gpu-0");
  caps.set_device("cuda:0");
  caps.set_device_name("NVIDIA H100 80GB HBM3");
  caps.set_device_memory_bytes(int64_t{80} << 30);
  caps.set_host_memory_bytes(int64_t{64} << 30);
  ASSERT_TRUE(controller_->AttachWorker(caps, "127.0.0.1", std::make_shared<FakeConnection>()).ok());
  req.mutable_spec()->mutable_data()->set_seq_len(int64_t{1} << 20);
  p = controller_->Plan(req);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_FALSE(p->fits());  // fits an H200, not 80 GB (as CreateJob decides)
  EXPECT_EQ(p->planned_gpu_bytes(), (int64_t{80} << 30) - (int64_t{3} << 30));
  EXPECT_THAT(p->hardware(), HasSubstr("worker gpu-0 (NVIDIA H100 80GB HBM3"));
  EXPECT_LT(p->max_seq_len(), int64_t{1} << 20);
  req.set_gpu_bytes(kH200GpuBytes);
  req.set_host_bytes(int64_t{110} << 30);
  p = controller_->Plan(req);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->fits()) << p->message();
  EXPECT_EQ(p->hardware(), "the request");
  EXPECT_TRUE(controller_->ListJobs(v1::ListJobsRequest(), kAnon)->jobs().empty());

  req.mutable_spec()->mutable_model()->set_name("/nowhere/model");
  EXPECT_EQ(controller_->Plan(req).status().code(), absl::StatusCode::kInvalidArgument);
}

// With only CPU workers attached, admission is by their host memory (planner::CpuHardware):
// a job that would have the kernel OOM-kill the worker is refused saying how much it needs.
TEST_F(ControllerTest, CpuWorkersAdmitByHostMemory) {
  v1::WorkerCapabilities caps;
  caps.set_worker_id("cpu-0");
  caps.set_device("cpu");
  caps.set_host_memory_bytes(int64_t{8} << 30);
  caps.set_device_memory_bytes(int64_t{8} << 30);  // a CPU worker reports its host memory as its device's
  ASSERT_TRUE(controller_->AttachWorker(caps, "127.0.0.1", std::make_shared<FakeConnection>()).ok());
  v1::CreateJobRequest huge = Request(1);
  huge.mutable_spec()->mutable_data()->set_batch_size(int64_t{1} << 20);  // 64 x 2^20 positions
  auto r = controller_->CreateJob(huge, kAnon);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("of host memory on a CPU worker"));
  EXPECT_THAT(r.status().message(), HasSubstr("CPU worker cpu-0 (8.0 GiB host memory"));
  // An RL session's capacity (seq_len x batch_size per call) is admitted the same way.
  v1::CreateJobRequest rl = Request(1);
  rl.mutable_spec()->set_kind(v1::RL_SESSION);
  rl.mutable_spec()->clear_steps();
  rl.mutable_spec()->mutable_model()->set_name("llama-3.2-1b");
  rl.mutable_spec()->mutable_data()->set_seq_len(4096);
  rl.mutable_spec()->mutable_data()->set_batch_size(16);
  r = controller_->CreateJob(rl, kAnon);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  // What fits is accepted; Plan answers the same on the same machine.
  EXPECT_TRUE(controller_->CreateJob(Request(1), kAnon).ok());
  v1::PlanRequest plan;
  *plan.mutable_spec() = huge.spec();
  auto answer = controller_->Plan(plan);
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_FALSE(answer->fits());
  EXPECT_THAT(answer->hardware(), HasSubstr("CPU worker cpu-0"));
}

// PlannerService plans for 85% of the attached GPU worker's host memory (the worker's own rule,
// planner::HostBudget) and 3 GiB less than its GPU; a spec's host budget wins over both the
// worker's and the request's host bytes.
TEST_F(ControllerTest, PlanUsesEightyFivePercentOfTheWorkersHostMemory) {
  v1::WorkerCapabilities caps;
  caps.set_worker_id("gpu-0");
  caps.set_device("cuda:0");
  caps.set_device_memory_bytes(int64_t{141} << 30);
  caps.set_host_memory_bytes(int64_t{200} << 30);
  ASSERT_TRUE(controller_->AttachWorker(caps, "127.0.0.1", std::make_shared<FakeConnection>()).ok());
  v1::PlanRequest req;
  *req.mutable_spec() = Request(1).spec();
  req.mutable_spec()->mutable_model()->set_name("llama-3.2-3b");
  req.mutable_spec()->mutable_data()->set_seq_len(65536);
  auto p = controller_->Plan(req);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->planned_host_bytes(), (int64_t{200} << 30) / 100 * 85);
  EXPECT_EQ(p->planned_gpu_bytes(), (int64_t{141} << 30) - (int64_t{3} << 30));
  EXPECT_LE(p->host_bytes(), p->planned_host_bytes());

  req.set_host_bytes(int64_t{50} << 30);  // the request's machine
  p = controller_->Plan(req);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->planned_host_bytes(), int64_t{50} << 30);

  req.mutable_spec()->mutable_memory()->set_host_budget_bytes(int64_t{10} << 30);  // the spec's budget wins
  p = controller_->Plan(req);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->planned_host_bytes(), int64_t{10} << 30);
  req.clear_host_bytes();
  p = controller_->Plan(req);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->planned_host_bytes(), int64_t{10} << 30);
}

}  // namespace
}  // namespace odyssey::server
