#include "worker/job_runner.h"

#include <cmath>
#include <filesystem>
#include <functional>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "worker/worker_metrics.h"

namespace odyssey::worker {
namespace {
namespace fs = std::filesystem;
namespace v1 = odyssey::v1;

v1::Assignment TinyJob(const std::string& dir, int64_t steps) {
  v1::Assignment a;
  a.set_job("jobs/7");
  a.set_rank(0);
  a.set_world_size(1);
  a.set_checkpoint_dir(dir);
  v1::JobSpec* s = a.mutable_spec();
  s->set_kind(v1::SFT);
  s->mutable_model()->set_name("tiny");
  s->mutable_model()->set_dtype("float32");
  s->mutable_optimizer()->set_lr(3e-3);
  s->mutable_optimizer()->set_warmup_steps(2);
  s->mutable_optimizer()->set_grad_clip(1.0);
  s->mutable_data()->set_format("kjv");
  s->mutable_data()->set_seq_len(16);
  s->mutable_data()->set_batch_size(2);
  s->mutable_data()->set_seed(5);
  s->set_steps(steps);
  s->mutable_checkpoint()->set_every_steps(2);
  s->mutable_checkpoint()->set_keep(2);
  return a;
}

// Collects what a run reports; Wait() blocks until its result (with a deadline).
struct Recorder {
  absl::Mutex mu;
  std::vector<v1::JobProgress> progress ABSL_GUARDED_BY(mu);
  std::optional<v1::JobResult> result ABSL_GUARDED_BY(mu);
  std::function<void(const v1::JobProgress&)> hook;  // called on the run's thread per progress

  JobCallbacks Callbacks() {
    return {[this](const v1::JobProgress& p) {
              {
                absl::MutexLock l(&mu);
                progress.push_back(p);
              }
              if (hook) hook(p);
            },
            [this](const v1::JobResult& r) {
              absl::MutexLock l(&mu);
              result = r;
            },
            nullptr};
  }
  v1::JobResult Wait(absl::Duration timeout = absl::Seconds(120)) {
    absl::MutexLock l(&mu);
    auto has = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return result.has_value(); };
    EXPECT_TRUE(mu.AwaitWithTimeout(absl::Condition(&has), timeout)) << "no result in time";
    return result.value_or(v1::JobResult());
  }
  bool WaitForProgress(absl::Duration timeout) {
    absl::MutexLock l(&mu);
    auto has = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return !progress.empty(); };
    return mu.AwaitWithTimeout(absl::Condition(&has), timeout);
  }
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class JobRunnerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SetTorchThreads(1);
    root_ = fs::temp_directory_path() /
            ("odyssey_job_runner_test_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  fs::path root_;
};

TEST_F(JobRunnerTest, RunsToTheEndWithAtomicCheckpointsKeepingK) {
  const std::string dir = (root_ / "ckpt").string();
  Recorder rec;
  JobRunnerOptions opts;
  opts.device = "cpu";
  opts.progress_interval_seconds = 0;  // every step
  JobRunner runner(TinyJob(dir, 6), opts, rec.Callbacks(), nullptr);
  v1::JobResult r = rec.Wait();
  EXPECT_TRUE(r.ok()) << r.error();
  EXPECT_EQ(r.job(), "jobs/7");
  EXPECT_EQ(r.step(), 6);
  EXPECT_EQ(r.last_checkpoint(), CheckpointPath(dir, 6));
  EXPECT_TRUE(runner.done());
  // keep = 2: steps 4 and 6 remain; no temp folders are left behind.
  EXPECT_EQ(ListCheckpoints(dir), (std::vector<std::string>{CheckpointPath(dir, 4), CheckpointPath(dir, 6)}));
  for (const auto& e : fs::directory_iterator(dir)) EXPECT_NE(e.path().filename().string()[0], '.') << e.path();
  EXPECT_TRUE(fs::exists(fs::path(CheckpointPath(dir, 6)) / "model.safetensors"));
  EXPECT_TRUE(fs::exists(fs::path(CheckpointPath(dir, 6)) / "optimizer.safetensors"));
  absl::MutexLock l(&rec.mu);
  ASSERT_EQ(rec.progress.size(), 6u);
  for (size_t i = 0; i < rec.progress.size(); ++i) {
    const v1::JobProgress& p = rec.progress[i];
    EXPECT_EQ(p.metrics().step(), static_cast<int64_t>(i + 1));
    EXPECT_TRUE(std::isfinite(p.metrics().loss()));
    EXPECT_EQ(p.metrics().tokens(), 32);
    EXPECT_GT(p.metrics().host_memory_peak_bytes(), 0);
    EXPECT_EQ(p.checkpoint().empty(), (i + 1) % 2 != 0) << "step " << i + 1;
  }
}

// A run resumed from step 4 continues at step 5 and ends with the same weights as a run that
// was never interrupted (optimizer state, step counter and data position all restored).
TEST_F(JobRunnerTest, ResumeContinuesTheStepCountAndMatchesAnUninterruptedRun) {
  JobRunnerOptions opts;
  opts.device = "cpu";
  opts.progress_interval_seconds = 0;
  const std::string straight = (root_ / "straight").string();
  {
    Recorder rec;
    JobRunner runner(TinyJob(straight, 8), opts, rec.Callbacks(), nullptr);
    ASSERT_TRUE(rec.Wait().ok());
  }
  // The first run of the 8-step job is stopped right after its step-4 checkpoint (the cancel
  // comes from the run's own thread, so no further step starts).
  const std::string first = (root_ / "first").string();
  {
    Recorder rec;
    absl::Notification runner_set;
    JobRunner* runner_ptr = nullptr;
    rec.hook = [&](const v1::JobProgress& p) {
      if (p.metrics().step() != 4) return;
      runner_set.WaitForNotification();
      runner_ptr->Cancel("interrupted");
    };
    JobRunner runner(TinyJob(first, 8), opts, rec.Callbacks(), nullptr);
    runner_ptr = &runner;
    runner_set.Notify();
    v1::JobResult r = rec.Wait();
    ASSERT_EQ(r.cancelled(), "interrupted");
    ASSERT_EQ(r.step(), 4);
    ASSERT_EQ(r.last_checkpoint(), CheckpointPath(first, 4));
  }
  // The second run continues the same 8-step job from the first's step-4 checkpoint.
  const std::string second = (root_ / "second").string();
  v1::Assignment a = TinyJob(second, 8);
  a.set_resume_from(CheckpointPath(first, 4));
  Recorder rec;
  JobRunner runner(a, opts, rec.Callbacks(), nullptr);
  v1::JobResult r = rec.Wait();
  ASSERT_TRUE(r.ok()) << r.error();
  EXPECT_EQ(r.step(), 8);
  {
    absl::MutexLock l(&rec.mu);
    ASSERT_FALSE(rec.progress.empty());
    EXPECT_EQ(rec.progress.front().metrics().step(), 5);
  }
  EXPECT_EQ(ReadFile(CheckpointPath(second, 8) + "/model.safetensors"),
            ReadFile(CheckpointPath(straight, 8) + "/model.safetensors"));
}

v1::Assignment RlJob(const std::string& dir, int64_t idle_timeout_seconds);

// Two jobs naming one checkpoint folder: the second (another owner: here job 1 of another
// controller store, as after a store was started over) fails at its start, before training, and
// the first's steps stay as they were; a restart of the first (its own owner) continues there and
// prunes only its own steps. Before owners, the second overwrote the first's step folders and its
// keep-K pruning deleted them.
TEST_F(JobRunnerTest, AFolderWithAnotherJobsStepsIsRefusedAtTheStart) {
  const std::string dir = (root_ / "shared").string();
  const std::string first_owner = "11111111111111111111111111111111/jobs/1";
  JobRunnerOptions opts;
  opts.device = "cpu";
  opts.progress_interval_seconds = 0;
  {
    Recorder rec;
    v1::Assignment a = TinyJob(dir, 6);  // keep 2: steps 4 and 6
    a.set_checkpoint_owner(first_owner);
    JobRunner runner(a, opts, rec.Callbacks(), nullptr);
    ASSERT_TRUE(rec.Wait().ok());
  }
  ASSERT_EQ(ListCheckpoints(dir), (std::vector<std::string>{CheckpointPath(dir, 4), CheckpointPath(dir, 6)}));
  EXPECT_EQ(ReadOwner(CheckpointPath(dir, 6)), first_owner);
  const std::string weights6 = ReadFile(CheckpointPath(dir, 6) + "/model.safetensors");
  {
    Recorder rec;
    v1::Assignment a = TinyJob(dir, 4);
    a.set_checkpoint_owner("22222222222222222222222222222222/jobs/1");
    JobRunner runner(a, opts, rec.Callbacks(), nullptr);
    v1::JobResult r = rec.Wait();
    EXPECT_FALSE(r.ok());
    EXPECT_NE(r.error().find("spec.checkpoint.directory: checkpoint folder \"" + dir + "\" holds step-00000004 of "
                             "another job"),
              std::string::npos)
        << r.error();
    EXPECT_EQ(r.step(), 0);
    absl::MutexLock l(&rec.mu);
    EXPECT_TRUE(rec.progress.empty()) << "it trained before refusing";
  }
  EXPECT_EQ(ListCheckpoints(dir), (std::vector<std::string>{CheckpointPath(dir, 4), CheckpointPath(dir, 6)}));
  EXPECT_EQ(ReadFile(CheckpointPath(dir, 6) + "/model.safetensors"), weights6);
  // The first job again (a restart, or a longer run of it): its own folder, continued.
  {
    Recorder rec;
    v1::Assignment a = TinyJob(dir, 10);
    a.set_checkpoint_owner(first_owner);
    a.set_resume_from(CheckpointPath(dir, 6));
    JobRunner runner(a, opts, rec.Callbacks(), nullptr);
    v1::JobResult r = rec.Wait();
    ASSERT_TRUE(r.ok()) << r.error();
    EXPECT_EQ(r.last_checkpoint(), CheckpointPath(dir, 10));
  }
  EXPECT_EQ(ListCheckpoints(dir), (std::vector<std::string>{CheckpointPath(dir, 8), CheckpointPath(dir, 10)}));
  // An RL session is refused the same way, before its model is built.
  {
    Recorder rec;
    v1::Assignment a = RlJob(dir, 0);
    a.set_checkpoint_owner("33333333333333333333333333333333/jobs/5");
    JobRunner runner(a, opts, rec.Callbacks(), nullptr);
    v1::JobResult r = rec.Wait();
    EXPECT_FALSE(r.ok());
    EXPECT_NE(r.error().find("holds step-00000008 of another job"), std::string::npos) << r.error();
  }
  EXPECT_EQ(ListCheckpoints(dir).size(), 2u);
}

TEST_F(JobRunnerTest, CancelStopsBetweenSteps) {
  Recorder rec;
  JobRunnerOptions opts;
  opts.device = "cpu";
  opts.progress_interval_seconds = 0;
  JobRunner runner(TinyJob((root_ / "c").string(), 1000000), opts, rec.Callbacks(), nullptr);
  ASSERT_TRUE(rec.WaitForProgress(absl::Seconds(60)));
  runner.Cancel("test says stop");
  v1::JobResult r = rec.Wait(absl::Seconds(30));
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.cancelled(), "test says stop");
  EXPECT_GT(r.step(), 0);
  EXPECT_LT(r.step(), 1000000);
}

TEST_F(JobRunnerTest, BadSpecFailsNamingTheField) {
  JobRunnerOptions opts;
  opts.device = "cpu";
  {
    Recorder rec;
    v1::Assignment a = TinyJob((root_ / "x").string(), 4);
    a.mutable_spec()->set_kind(static_cast<v1::JobKind>(9));
    JobRunner runner(a, opts, rec.Callbacks(), nullptr);
    v1::JobResult r = rec.Wait();
    EXPECT_FALSE(r.ok());
    EXPECT_NE(r.error().find("spec.kind (9)"), std::string::npos) << r.error();
  }
  {
    Recorder rec;
    v1::Assignment a = RlJob((root_ / "x").string(), 0);
    a.set_world_size(2);
    a.set_rank(2);
    JobRunner runner(a, opts, rec.Callbacks(), nullptr);
    v1::JobResult r = rec.Wait();
    EXPECT_FALSE(r.ok());
    EXPECT_NE(r.error().find("rank (2) must be in [0, world_size (2))"), std::string::npos) << r.error();
  }
}

// A TCP socket bound to a loopback port the kernel picks, listening when `listen`; *port is
// that port.
int LoopbackSocket(bool listen, int* port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  EXPECT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  if (listen) {
    EXPECT_EQ(::listen(fd, 4), 0);
  }
  EXPECT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  *port = ntohs(addr.sin_port);
  return fd;
}

// A TCP port free now (the kernel's pick for port 0; nobody listens on it once this returns).
int FreePort() {
  int port = 0;
  ::close(LoopbackSocket(/*listen=*/false, &port));
  return port;
}

// True when a socket of this machine listens on TCP `port` (read from /proc/net/tcp{,6}, so
// the check neither connects nor binds: it cannot disturb the listener).
bool Listening(int port) {
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state;
      fields >> slot >> local >> remote >> state;
      const size_t colon = local.rfind(':');
      if (colon == std::string::npos || state != "0A") continue;  // 0A: TCP_LISTEN
      if (std::stoi(local.substr(colon + 1), nullptr, 16) == port) return true;
    }
  }
  return false;
}

// A multi-rank RL session waits for its peers at the rendezvous; a cancel meanwhile ends the
// wait at once (not after the 120 s connect timeout) with a cancelled result. The cancel comes
// once rank 0 listens at the rendezvous, so the wait it interrupts is the peers' one.
TEST_F(JobRunnerTest, RlSessionCancelledWhileWaitingForItsPeers) {
  JobRunnerOptions opts;
  opts.device = "cpu";
  Recorder rec;
  v1::Assignment a = RlJob((root_ / "x").string(), 0);
  a.set_world_size(2);
  a.set_rank(0);
  const int port = FreePort();
  a.set_rendezvous(absl::StrCat("127.0.0.1:", port));  // rank 0 listens; rank 1 never comes
  JobRunner runner(a, opts, rec.Callbacks(), nullptr);
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (!Listening(port) && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_TRUE(Listening(port)) << "rank 0 did not listen on " << port << " within 60 s";
  {
    absl::MutexLock l(&rec.mu);
    ASSERT_FALSE(rec.result.has_value()) << "the run ended before the cancel: " << rec.result->error();
  }
  const absl::Time cancelled = absl::Now();
  runner.Cancel("test says stop");
  v1::JobResult r = rec.Wait(absl::Seconds(30));
  EXPECT_LT(absl::Now() - cancelled, absl::Seconds(10));
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.cancelled(), "test says stop") << r.error();
  {
    Recorder rec;
    v1::Assignment a = TinyJob((root_ / "x").string(), 4);
    a.set_resume_from((root_ / "nowhere").string());
    JobRunner runner(a, opts, rec.Callbacks(), nullptr);
    v1::JobResult r = rec.Wait();
    EXPECT_FALSE(r.ok());
    EXPECT_NE(r.error().find("resume_from"), std::string::npos) << r.error();
  }
}

// Rank 0 of an SFT run and of an RL session whose rendezvous port another process holds: the
// run fails before any step with rendezvous_failed set (the controller tries again on another
// port); a failure of the job itself does not set it.
TEST_F(JobRunnerTest, ATakenRendezvousPortIsReportedAsTheRanksNotMeeting) {
  JobRunnerOptions opts;
  opts.device = "cpu";
  int port = 0;
  const int fd = LoopbackSocket(/*listen=*/true, &port);  // another process's listener
  ASSERT_FALSE(HasFailure()) << "no loopback listener";
  const std::string taken = absl::StrCat("127.0.0.1:", port);
  for (bool rl : {false, true}) {
    Recorder rec;
    v1::Assignment a = rl ? RlJob((root_ / "rl").string(), 0) : TinyJob((root_ / "sft").string(), 4);
    a.set_world_size(2);
    a.set_rank(0);
    a.set_rendezvous(taken);
    JobRunner runner(a, opts, rec.Callbacks(), nullptr);
    v1::JobResult r = rec.Wait(absl::Seconds(60));
    EXPECT_FALSE(r.ok()) << (rl ? "RL" : "SFT");
    EXPECT_TRUE(r.cancelled().empty()) << r.cancelled();
    EXPECT_NE(r.error().find("bind/listen"), std::string::npos) << r.error();
    EXPECT_TRUE(r.rendezvous_failed()) << (rl ? "RL: " : "SFT: ") << r.error();
    EXPECT_EQ(r.step(), 0);
  }
  ::close(fd);
  Recorder rec;
  v1::Assignment a = TinyJob((root_ / "y").string(), 4);
  a.set_resume_from((root_ / "nowhere").string());
  JobRunner runner(a, opts, rec.Callbacks(), nullptr);
  v1::JobResult r = rec.Wait();
  EXPECT_FALSE(r.ok());
  EXPECT_FALSE(r.rendezvous_failed()) << r.error();
}

// Every MemorySpec field reaches the engine's options, set or unset as the spec says (the
// converter is planner::MemoryFieldsFromProto, the one CreateJob's validation uses).
TEST(AssignmentToEngineOptionsTest, EveryMemoryFieldArrives) {
  v1::Assignment a;
  a.set_job("jobs/1");
  a.mutable_spec()->set_steps(1);
  v1::MemorySpec* m = a.mutable_spec()->mutable_memory();
  absl::StatusOr<EngineJobOptions> unset = AssignmentToEngineOptions(a, "cpu");
  ASSERT_TRUE(unset.ok()) << unset.status();
  EXPECT_FALSE(unset->memory.AnySet());
  m->set_recompute("layer");
  m->set_offload("on");
  m->set_device_resident(1);
  m->set_attention_head_groups(2);
  m->set_keep_attention(true);
  m->set_optimizer_on_host(true);
  m->set_host_budget_bytes(int64_t{1} << 30);
  absl::StatusOr<EngineJobOptions> set = AssignmentToEngineOptions(a, "cpu");
  ASSERT_TRUE(set.ok()) << set.status();
  const planner::MemoryStrategy s = set->memory.ApplyTo(planner::MemoryStrategy{});
  EXPECT_EQ(s.recompute, planner::Recompute::kLayer);
  EXPECT_TRUE(s.offload);
  EXPECT_EQ(s.device_resident, 1);
  EXPECT_EQ(s.head_groups, 2);
  EXPECT_TRUE(s.keep_attention);
  EXPECT_TRUE(s.optimizer_on_host);
  EXPECT_EQ(s.host_budget_bytes, int64_t{1} << 30);
  EXPECT_TRUE(s.Validate().ok()) << s.Validate();
}

// spec.profile.phase_times: every progress report carries its step's phase times (rank 0's),
// each layer's forward among them, and the worker's gauges get the last step's; a run without it
// reports none. RL sessions refuse it, naming the field.
TEST_F(JobRunnerTest, PhaseTimesArriveWithEveryStep) {
  for (bool timed : {false, true}) {
    Recorder rec;
    JobRunnerOptions opts;
    opts.device = "cpu";
    opts.progress_interval_seconds = 0;  // every step
    v1::Assignment a = TinyJob("", 3);
    a.mutable_spec()->mutable_profile()->set_phase_times(timed);
    WorkerMetrics metrics;
    JobRunner runner(a, opts, rec.Callbacks(), &metrics);
    v1::JobResult r = rec.Wait();
    ASSERT_TRUE(r.ok()) << r.error();
    absl::MutexLock l(&rec.mu);
    ASSERT_EQ(rec.progress.size(), 3u);
    for (const v1::JobProgress& p : rec.progress) {
      if (!timed) {
        EXPECT_EQ(p.metrics().phases_size(), 0);
        continue;
      }
      std::map<std::string, v1::PhaseSeconds> by_phase;
      for (const v1::PhaseSeconds& ph : p.metrics().phases()) by_phase[ph.phase()] = ph;
      EXPECT_EQ(by_phase["layer # forward"].count(), 4) << "tiny has 4 layers";
      EXPECT_GT(by_phase["optimizer"].seconds(), 0);
      EXPECT_LE(by_phase["backward"].seconds(), p.metrics().step_seconds());
      for (int i = 1; i < p.metrics().phases_size(); ++i)
        EXPECT_GE(p.metrics().phases(i - 1).seconds(), p.metrics().phases(i).seconds()) << "longest first";
    }
    const bool exported = metrics.phase_seconds->Has({{"phase", "optimizer"}});
    EXPECT_EQ(exported, timed);
  }
}


// spec.profile.trace_step: rank 0 records that step with the profiler into the checkpoint
// folder's profile/, under the job's name, and names the file in that step's progress only.
TEST_F(JobRunnerTest, TraceStepWritesTheTraceBesideTheCheckpoints) {
  const std::string dir = (root_ / "ckpt").string();
  Recorder rec;
  JobRunnerOptions opts;
  opts.device = "cpu";
  opts.progress_interval_seconds = 0;
  v1::Assignment a = TinyJob(dir, 3);
  a.mutable_spec()->mutable_profile()->set_trace_step(2);
  JobRunner runner(a, opts, rec.Callbacks(), nullptr);
  v1::JobResult r = rec.Wait();
  ASSERT_TRUE(r.ok()) << r.error();
  const std::string want = (fs::path(dir) / "profile" / "jobs-7-step-00000002.trace.json").string();
  EXPECT_EQ(TracePath(dir, "jobs/7", 2), want);
  ASSERT_TRUE(fs::exists(want));
  const std::string text = ReadFile(want);
  EXPECT_NE(text.find("\"traceEvents\""), std::string::npos) << "not a Chrome trace";
  EXPECT_NE(text.find("layer 0 forward"), std::string::npos) << "the step's phases are not in the trace";
  absl::MutexLock l(&rec.mu);
  ASSERT_EQ(rec.progress.size(), 3u);
  for (const v1::JobProgress& p : rec.progress)
    EXPECT_EQ(p.metrics().trace(), p.metrics().step() == 2 ? want : "") << "step " << p.metrics().step();
  // Without a checkpoint folder there is nowhere to write it: refused at the start.
  Recorder none;
  v1::Assignment b = TinyJob("", 2);
  b.mutable_spec()->mutable_profile()->set_trace_step(1);
  JobRunner refused(b, opts, none.Callbacks(), nullptr);
  v1::JobResult rb = none.Wait();
  EXPECT_FALSE(rb.ok());
  EXPECT_NE(rb.error().find("spec.profile.trace_step"), std::string::npos) << rb.error();
}

// The spec's memory strategy reaches the engine: layer recompute with tiled MLP and loss trains
// the same model as the plain step (fp32 on CPU: equal up to rounding), and with offload the
// worker runs what the spec says (the pool the job reports holds the offloaded layer inputs:
// a worker that ignored spec.memory would report none).
TEST_F(JobRunnerTest, MemorySpecIsAppliedAndChangesNothingButMemory) {
  JobRunnerOptions opts;
  opts.device = "cpu";
  opts.progress_interval_seconds = 0;
  auto run = [&](const std::string& dir, const std::function<void(v1::MemorySpec*)>& fill) {
    v1::Assignment a = TinyJob((root_ / dir).string(), 3);
    if (fill) fill(a.mutable_spec()->mutable_memory());
    Recorder rec;
    JobRunner runner(a, opts, rec.Callbacks(), nullptr);
    EXPECT_TRUE(rec.Wait().ok());
    absl::MutexLock l(&rec.mu);
    return rec.progress;
  };
  auto losses = [](const std::vector<v1::JobProgress>& progress) {
    std::vector<double> out;
    for (const auto& p : progress) out.push_back(p.metrics().loss());
    return out;
  };
  const std::vector<v1::JobProgress> plain_run = run("plain", nullptr);
  const std::vector<v1::JobProgress> tiled_run = run("tiled", [](v1::MemorySpec* m) {
    m->set_recompute("layer");
    m->set_mlp_tile_tokens(8);
    m->set_loss_tile_tokens(8);
    m->set_offload("off");
  });
  const std::vector<v1::JobProgress> offloaded_run = run("offloaded", [](v1::MemorySpec* m) {
    m->set_recompute("layer");
    m->set_offload("on");
    m->set_device_resident(1);
  });
  std::vector<double> plain = losses(plain_run), tiled = losses(tiled_run), offloaded = losses(offloaded_run);
  ASSERT_EQ(plain.size(), 3u);
  ASSERT_EQ(tiled.size(), 3u);
  ASSERT_EQ(offloaded.size(), 3u);
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_NEAR(plain[i], tiled[i], 1e-5 * plain[i]) << "step " << i + 1;
    EXPECT_NEAR(plain[i], offloaded[i], 1e-5 * plain[i]) << "step " << i + 1;
  }
  // The tiny model: 4 layers of hidden 128; a batch of 2 x 16 fp32 positions. Layer recompute
  // saves 3 inputs (the first layer's, the embedding of the ids, is recomputed in its backward);
  // device_resident 1 keeps the last on the device and offloads 2.
  constexpr int64_t kInputBytes = 2 * 16 * 128 * 4;
  EXPECT_EQ(plain_run.back().metrics().host_offload_bytes(), 0);
  EXPECT_EQ(tiled_run.back().metrics().host_offload_bytes(), 0);
  EXPECT_EQ(offloaded_run.back().metrics().host_offload_bytes(), 2 * kInputBytes);

  v1::Assignment bad = TinyJob((root_ / "bad").string(), 3);
  bad.mutable_spec()->mutable_memory()->set_offload("sometimes");
  Recorder rec;
  JobRunner runner(bad, opts, rec.Callbacks(), nullptr);
  v1::JobResult r = rec.Wait();
  EXPECT_FALSE(r.ok());
  EXPECT_NE(r.error().find("spec.memory.offload: ('sometimes') must be on, off, auto or empty"), std::string::npos)
      << r.error();
}

// ---------------------------------------------------------------------------------------------
// RL sessions

v1::Assignment RlJob(const std::string& dir, int64_t idle_timeout_seconds) {
  v1::Assignment a = TinyJob(dir, 0);
  v1::JobSpec* s = a.mutable_spec();
  s->set_kind(v1::RL_SESSION);
  s->clear_steps();
  s->mutable_data()->clear_format();
  s->mutable_optimizer()->clear_lr();  // unused: every optim_step carries its own
  s->mutable_rl()->set_idle_timeout_seconds(idle_timeout_seconds);
  return a;
}

// Collects an RL run's replies besides its progress and result.
struct RlRecorder : Recorder {
  std::vector<v1::TrainingReply> replies ABSL_GUARDED_BY(mu);
  JobCallbacks Callbacks() {
    JobCallbacks c = Recorder::Callbacks();
    c.reply = [this](const v1::TrainingReply& r) {
      absl::MutexLock l(&mu);
      replies.push_back(r);
    };
    return c;
  }
  // The replies once there are `n` (waits up to 120 s).
  std::vector<v1::TrainingReply> WaitReplies(size_t n) {
    absl::MutexLock l(&mu);
    auto has = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return replies.size() >= n; };
    EXPECT_TRUE(mu.AwaitWithTimeout(absl::Condition(&has), absl::Seconds(120))) << "replies: " << replies.size();
    return replies;
  }
};

v1::TrainingCall Call(int64_t id, const std::function<void(v1::TrainingCall&)>& fill) {
  v1::TrainingCall c;
  c.set_call_id(id);
  c.set_job("jobs/7");
  fill(c);
  return c;
}

v1::TrainingCall FbCall(int64_t id, int first_token = 1) {
  return Call(id, [first_token](v1::TrainingCall& c) {
    v1::Datum* d = c.mutable_forward_backward()->add_batch();
    for (int i = 0; i < 12; ++i) {
      d->add_tokens((first_token + i * 7) % 256);
      d->add_target_tokens((first_token + i * 7 + 7) % 256);
    }
    c.mutable_forward_backward()->mutable_loss()->set_kind("cross_entropy");
  });
}

v1::TrainingCall StepCall(int64_t id) {
  return Call(id, [](v1::TrainingCall& c) { c.mutable_optim_step()->mutable_adam()->set_lr(1e-2); });
}

// Calls submitted at once run FIFO; replies carry their call ids; the engine's INVALID_ARGUMENT
// comes back unchanged and the session keeps working; save/load/export write where they say;
// progress follows the optimizer steps; the idle timeout ends the run with an ok result.
TEST_F(JobRunnerTest, RlSessionServesCallsInOrderAndEndsWhenIdle) {
  const std::string dir = (root_ / "ckpt").string();
  RlRecorder rec;
  JobRunnerOptions opts;
  opts.device = "cpu";
  JobRunner runner(RlJob(dir, 2), opts, rec.Callbacks(), nullptr);
  // Submitted while the model loads: they queue.
  ASSERT_TRUE(runner.Submit(FbCall(1)));
  ASSERT_TRUE(runner.Submit(StepCall(2)));
  ASSERT_TRUE(runner.Submit(Call(3, [](v1::TrainingCall& c) {
    v1::Datum* d = c.mutable_forward_backward()->add_batch();
    d->add_tokens(1);
    d->add_target_tokens(999);
    c.mutable_forward_backward()->mutable_loss()->set_kind("cross_entropy");
  })));
  ASSERT_TRUE(runner.Submit(FbCall(4)));
  ASSERT_TRUE(runner.Submit(StepCall(5)));
  ASSERT_TRUE(runner.Submit(Call(6, [](v1::TrainingCall& c) { c.mutable_save_checkpoint(); })));
  ASSERT_TRUE(runner.Submit(Call(7, [&](v1::TrainingCall& c) {
    c.mutable_export_weights()->set_directory((root_ / "export").string());
    c.mutable_export_weights()->set_dtype("bfloat16");
  })));
  ASSERT_TRUE(runner.Submit(FbCall(8)));
  ASSERT_TRUE(runner.Submit(StepCall(9)));
  ASSERT_TRUE(runner.Submit(Call(10, [&](v1::TrainingCall& c) {  // an export is not a checkpoint
    c.mutable_load_checkpoint()->set_directory((root_ / "export").string());
  })));
  ASSERT_TRUE(runner.Submit(FbCall(11)));  // pending gradients the load drops
  ASSERT_TRUE(runner.Submit(Call(12, [&](v1::TrainingCall& c) {
    c.mutable_load_checkpoint()->set_directory(CheckpointPath(dir, 2));
  })));
  ASSERT_TRUE(runner.Submit(StepCall(13)));
  const std::vector<v1::TrainingReply> r = rec.WaitReplies(13);
  ASSERT_EQ(r.size(), 13u);
  for (size_t i = 0; i < r.size(); ++i) {
    EXPECT_EQ(r[i].call_id(), static_cast<int64_t>(i + 1));
    EXPECT_EQ(r[i].job(), "jobs/7");
    if (i != 2 && i != 9 && i != 12) {
      EXPECT_EQ(r[i].code(), 0) << "call " << i + 1 << ": " << r[i].message();
    }
  }
  EXPECT_EQ(r[0].forward_backward().logprobs_size(), 1);
  EXPECT_EQ(r[0].forward_backward().logprobs(0).values_size(), 12);
  EXPECT_EQ(r[0].forward_backward().tokens(), 12);
  EXPECT_EQ(r[1].optim_step().step(), 1);
  EXPECT_EQ(r[2].code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(r[2].message(), "batch[0].target_tokens[0] (999) must be in [0, 256), the model's vocabulary");
  EXPECT_EQ(r[4].optim_step().step(), 2);
  EXPECT_EQ(r[5].save_checkpoint().directory(), CheckpointPath(dir, 2));
  EXPECT_EQ(r[5].save_checkpoint().step(), 2);
  EXPECT_TRUE(fs::exists(fs::path(CheckpointPath(dir, 2)) / "optimizer.safetensors"));
  EXPECT_EQ(r[6].export_weights().directory(), (root_ / "export").string());
  EXPECT_TRUE(fs::exists(root_ / "export" / "config.json"));
  EXPECT_NE(ReadFile((root_ / "export" / "config.json").string()).find("bfloat16"), std::string::npos);
  EXPECT_EQ(r[8].optim_step().step(), 3);
  EXPECT_EQ(r[9].code(), static_cast<int>(absl::StatusCode::kFailedPrecondition)) << r[9].message();
  EXPECT_NE(r[9].message().find("no trainer_state.json"), std::string::npos) << r[9].message();
  EXPECT_EQ(r[11].load_checkpoint().step(), 2);
  // The load dropped the gradients of call 11 (computed on the replaced weights).
  EXPECT_EQ(r[12].code(), static_cast<int>(absl::StatusCode::kFailedPrecondition)) << r[12].message();
  // No call for 2 s: the session ends ok at the loaded step.
  const v1::JobResult result = rec.Wait();
  EXPECT_TRUE(result.ok()) << result.error();
  EXPECT_EQ(result.step(), 2);
  EXPECT_EQ(result.last_checkpoint(), CheckpointPath(dir, 2));
  EXPECT_FALSE(runner.Submit(FbCall(14)));  // ended: nothing queues
  absl::MutexLock l(&rec.mu);
  // Progress after each optim_step, the save and the load: step and the last loss.
  std::vector<int64_t> steps;
  for (const auto& p : rec.progress) steps.push_back(p.metrics().step());
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 2, 3, 2}));
  EXPECT_EQ(rec.progress[2].checkpoint(), CheckpointPath(dir, 2));
  EXPECT_DOUBLE_EQ(rec.progress[0].metrics().loss(), r[0].forward_backward().loss());
}

// An RL session with spec.profile.phase_times answers each forward_backward and optim_step
// with the call's phase times; other calls carry none.
TEST_F(JobRunnerTest, RlSessionCallsCarryTheirPhaseTimes) {
  RlRecorder rec;
  JobRunnerOptions opts;
  opts.device = "cpu";
  v1::Assignment a = RlJob((root_ / "ckpt").string(), 1);
  a.mutable_spec()->mutable_profile()->set_phase_times(true);
  JobRunner runner(a, opts, rec.Callbacks(), nullptr);
  ASSERT_TRUE(runner.Submit(FbCall(1)));
  ASSERT_TRUE(runner.Submit(StepCall(2)));
  ASSERT_TRUE(runner.Submit(Call(3, [](v1::TrainingCall& c) { c.mutable_save_checkpoint(); })));
  const std::vector<v1::TrainingReply> r = rec.WaitReplies(3);
  ASSERT_EQ(r.size(), 3u);
  for (const auto& reply : r) ASSERT_EQ(reply.code(), 0) << reply.message();
  std::map<std::string, v1::PhaseSeconds> fb, step;
  for (const v1::PhaseSeconds& ph : r[0].forward_backward().phases()) fb[ph.phase()] = ph;
  for (const v1::PhaseSeconds& ph : r[1].optim_step().phases()) step[ph.phase()] = ph;
  EXPECT_EQ(fb["layer # forward"].count(), 4) << "tiny has 4 layers";
  EXPECT_EQ(fb["backward"].count(), 1) << "one group of datums: one backward";
  EXPECT_GT(fb["backward"].seconds(), 0);
  EXPECT_EQ(fb.count("optimizer"), 0u) << "the optimizer runs in optim_step";
  EXPECT_EQ(step["optimizer"].count(), 1);
  EXPECT_EQ(step.count("backward"), 0u);
  runner.Cancel("done");
  rec.Wait();
}

// A cancel ends the session after the call that runs; the calls still queued get ABORTED.
TEST_F(JobRunnerTest, RlSessionCancelAbortsQueuedCalls) {
  RlRecorder rec;
  JobRunnerOptions opts;
  opts.device = "cpu";
  JobRunner runner(RlJob((root_ / "c").string(), 0), opts, rec.Callbacks(), nullptr);
  ASSERT_TRUE(runner.Submit(FbCall(1)));
  ASSERT_EQ(rec.WaitReplies(1).size(), 1u);
  for (int i = 2; i <= 20; ++i) ASSERT_TRUE(runner.Submit(FbCall(i, i)));
  runner.Cancel("test says stop");
  const v1::JobResult result = rec.Wait(absl::Seconds(60));
  EXPECT_FALSE(result.ok());
  EXPECT_EQ(result.cancelled(), "test says stop");
  const std::vector<v1::TrainingReply> r = rec.WaitReplies(20);
  ASSERT_EQ(r.size(), 20u);
  int aborted = 0;
  for (const auto& reply : r) {
    if (reply.code() == static_cast<int>(absl::StatusCode::kAborted)) {
      ++aborted;
      EXPECT_NE(reply.message().find("cancelled"), std::string::npos) << reply.message();
    }
  }
  EXPECT_GT(aborted, 0);
}

// spec.resume_from (a new job, its own checkpoint folder, the spec naming another run's step-4
// checkpoint) continues at step 5 with the losses, step for step, and the final weights of the
// run that was never interrupted: weights, optimizer state, step counter and data position all
// come from the checkpoint. A folder that is no checkpoint, or one whose optimizer state does not
// fit the run, fails the job naming spec.resume_from.
TEST_F(JobRunnerTest, SpecResumeFromGivesTheLossesOfTheUninterruptedRun) {
  JobRunnerOptions opts;
  opts.device = "cpu";
  opts.progress_interval_seconds = 0;  // a progress per step: every loss
  auto losses = [](Recorder& rec) {
    absl::MutexLock l(&rec.mu);
    std::map<int64_t, double> out;
    for (const v1::JobProgress& p : rec.progress) out[p.metrics().step()] = p.metrics().loss();
    return out;
  };
  const std::string straight = (root_ / "straight").string();
  std::map<int64_t, double> uninterrupted;
  {
    Recorder rec;
    v1::Assignment a = TinyJob(straight, 8);
    a.mutable_spec()->mutable_checkpoint()->set_keep(0);  // every second step, all kept
    JobRunner runner(a, opts, rec.Callbacks(), nullptr);
    ASSERT_TRUE(rec.Wait().ok());
    uninterrupted = losses(rec);
  }
  ASSERT_EQ(uninterrupted.size(), 8u);
  const std::string resumed_dir = (root_ / "resumed").string();
  v1::Assignment a = TinyJob(resumed_dir, 8);
  a.set_job("jobs/8");
  a.mutable_spec()->set_resume_from(CheckpointPath(straight, 4));
  Recorder rec;
  {
    JobRunner runner(a, opts, rec.Callbacks(), nullptr);
    v1::JobResult r = rec.Wait();
    ASSERT_TRUE(r.ok()) << r.error();
    EXPECT_EQ(r.step(), 8);
  }
  const std::map<int64_t, double> resumed = losses(rec);
  ASSERT_EQ(resumed.size(), 4u);
  for (const auto& [step, loss] : resumed) {
    EXPECT_GE(step, 5);
    EXPECT_EQ(loss, uninterrupted.at(step)) << "step " << step;  // bitwise: the same computation
  }
  EXPECT_EQ(ReadFile(CheckpointPath(resumed_dir, 8) + "/model.safetensors"),
            ReadFile(CheckpointPath(straight, 8) + "/model.safetensors"));
  EXPECT_EQ(ReadFile(CheckpointPath(resumed_dir, 8) + "/optimizer.safetensors"),
            ReadFile(CheckpointPath(straight, 8) + "/optimizer.safetensors"));
  // The controller's resume_from (the job's own newest checkpoint, after a worker loss) wins.
  {
    v1::Assignment b = TinyJob((root_ / "restarted").string(), 8);
    b.mutable_spec()->set_resume_from(CheckpointPath(straight, 2));
    b.set_resume_from(CheckpointPath(straight, 6));
    Recorder rec;
    JobRunner runner(b, opts, rec.Callbacks(), nullptr);
    ASSERT_TRUE(rec.Wait().ok());
    EXPECT_EQ(losses(rec).begin()->first, 7);
  }
  // Errors name the field.
  auto fails = [&](const std::function<void(v1::Assignment&)>& edit) {
    v1::Assignment b = TinyJob((root_ / "bad").string(), 8);
    edit(b);
    Recorder rec;
    JobRunner runner(b, opts, rec.Callbacks(), nullptr);
    v1::JobResult r = rec.Wait();
    EXPECT_FALSE(r.ok());
    return r.error();
  };
  std::string e = fails([&](v1::Assignment& b) { b.mutable_spec()->set_resume_from((root_ / "nowhere").string()); });
  EXPECT_NE(e.find("spec.resume_from " + (root_ / "nowhere").string()), std::string::npos) << e;
  // A float32 run's optimizer state has no fp32 masters, which a bfloat16 run needs.
  e = fails([&](v1::Assignment& b) {
    b.mutable_spec()->set_resume_from(CheckpointPath(straight, 4));
    b.mutable_spec()->mutable_model()->set_dtype("bfloat16");
  });
  EXPECT_NE(e.find("spec.resume_from"), std::string::npos) << e;
  EXPECT_NE(e.find("missing tensor 'master."), std::string::npos) << e;
}

// A checkpoint of a job whose model.name is a Hugging Face folder, and an RL session's
// ExportWeights, are complete model folders: the base folder's tokenizer and generation files
// come along byte for byte (ready for vLLM / transformers), its other files do not.
TEST_F(JobRunnerTest, CheckpointsAndExportsCarryTheBaseModelsTokenizerFiles) {
  JobRunnerOptions opts;
  opts.device = "cpu";
  const fs::path base = root_ / "base";
  {
    Recorder rec;
    JobRunner runner(TinyJob((root_ / "make-base").string(), 2), opts, rec.Callbacks(), nullptr);
    ASSERT_TRUE(rec.Wait().ok());
  }
  fs::create_directories(base);
  for (const char* f : {"config.json", "model.safetensors"}) {
    fs::copy_file(fs::path(CheckpointPath((root_ / "make-base").string(), 2)) / f, base / f);
  }
  const std::map<std::string, std::string> extras = {
      {"tokenizer.json", "{\"version\": \"1.0\", \"model\": {\"type\": \"BPE\", \"vocab\": {}}}"},
      {"tokenizer_config.json", "{\"bos_token\": \"<s>\", \"chat_template\": \"{{ messages }}\"}"},
      {"special_tokens_map.json", "{\"bos_token\": \"<s>\"}"},
      {"generation_config.json", "{\"do_sample\": true, \"temperature\": 0.6, \"top_p\": 0.9}"}};
  for (const auto& [name, text] : extras) std::ofstream(base / name) << text;
  std::ofstream(base / "notes.txt") << "not a model file";
  auto expect_complete = [&](const fs::path& folder) {
    for (const auto& [name, text] : extras) EXPECT_EQ(ReadFile((folder / name).string()), text) << folder / name;
    EXPECT_FALSE(fs::exists(folder / "notes.txt")) << folder;
    EXPECT_TRUE(fs::exists(folder / "config.json")) << folder;
  };
  {
    Recorder rec;
    v1::Assignment a = TinyJob((root_ / "sft").string(), 2);
    a.mutable_spec()->mutable_model()->set_name(base.string());
    JobRunner runner(a, opts, rec.Callbacks(), nullptr);
    v1::JobResult r = rec.Wait();
    ASSERT_TRUE(r.ok()) << r.error();
    expect_complete(CheckpointPath((root_ / "sft").string(), 2));
  }
  RlRecorder rec;
  v1::Assignment a = RlJob((root_ / "rl").string(), 60);
  a.mutable_spec()->mutable_model()->set_name(base.string());
  JobRunner runner(a, opts, rec.Callbacks(), nullptr);
  ASSERT_TRUE(runner.Submit(Call(1, [&](v1::TrainingCall& c) {
    c.mutable_export_weights()->set_directory((root_ / "export").string());
  })));
  const std::vector<v1::TrainingReply> r = rec.WaitReplies(1);
  ASSERT_EQ(r.size(), 1u);
  ASSERT_EQ(r[0].code(), 0) << r[0].message();
  expect_complete(root_ / "export");
  runner.Cancel("done");
  rec.Wait();
}

// On a GPU: the session's trainer is built as an SFT run's would be there (dtype auto = bf16, the
// planner's memory strategy for seq_len x batch_size = 8192 positions) and trains: the loss of a
// fixed 4096-token batch (each token followed by itself + 7) falls by more than 1.5 nats over 16
// forward_backward + optim_step calls at lr 1e-3 (fp32 on a CPU: 5.58 -> 3.23), each step's
// progress reports the GPU's peak memory, and forward's logprobs are finite. Skips where there is no GPU.
TEST_F(JobRunnerTest, RlSessionTrainsOnTheGpu) {
  if (!ProbeDevice("cuda:0").ok()) GTEST_SKIP() << "no CUDA device";
  RlRecorder rec;
  JobRunnerOptions opts;
  opts.device = "cuda:0";
  v1::Assignment a = RlJob((root_ / "gpu").string(), 0);
  a.mutable_spec()->mutable_model()->clear_dtype();
  a.mutable_spec()->mutable_data()->set_seq_len(4096);  // the tiny model's max_position_embeddings
  a.mutable_spec()->mutable_data()->set_batch_size(2);
  JobRunner runner(a, opts, rec.Callbacks(), nullptr);
  auto batch = [](v1::Datum* d) {
    for (int i = 0; i < 4096; ++i) {
      d->add_tokens((i * 7) % 256);
      d->add_target_tokens(((i + 1) * 7) % 256);
    }
  };
  constexpr int kSteps = 16;
  int64_t id = 0;
  for (int step = 0; step < kSteps; ++step) {
    ASSERT_TRUE(runner.Submit(Call(++id, [&](v1::TrainingCall& c) {
      batch(c.mutable_forward_backward()->add_batch());
      c.mutable_forward_backward()->mutable_loss()->set_kind("cross_entropy");
    })));
    ASSERT_TRUE(runner.Submit(Call(++id, [](v1::TrainingCall& c) { c.mutable_optim_step()->mutable_adam()->set_lr(1e-3); })));
  }
  ASSERT_TRUE(runner.Submit(Call(++id, [&](v1::TrainingCall& c) { batch(c.mutable_forward()->add_batch()); })));
  const std::vector<v1::TrainingReply> r = rec.WaitReplies(static_cast<size_t>(id));
  ASSERT_EQ(r.size(), static_cast<size_t>(id));
  for (const auto& reply : r) ASSERT_EQ(reply.code(), 0) << reply.message();
  const auto& first_fb = r[0].forward_backward();
  const auto& last_fb = r[2 * kSteps - 2].forward_backward();
  std::cout << "GPU RL session: loss " << first_fb.loss() << " -> " << last_fb.loss() << ", " << first_fb.seconds()
            << " s for the first forward_backward, " << last_fb.seconds() << " s for the last\n";
  EXPECT_LT(last_fb.loss(), first_fb.loss() - 1.5);
  {  // every optim_step's progress carries the device's peak over the step's calls
    absl::MutexLock l(&rec.mu);
    ASSERT_EQ(rec.progress.size(), static_cast<size_t>(kSteps));
    const int64_t peak = rec.progress.back().metrics().gpu_memory_peak_bytes();
    std::cout << "GPU RL session: peak allocated " << peak / (1 << 20) << " MiB over the last step's calls\n";
    EXPECT_GT(peak, int64_t{1} << 20);
  }
  EXPECT_EQ(r[2 * kSteps - 1].optim_step().step(), kSteps);
  ASSERT_EQ(r[2 * kSteps].forward().logprobs(0).values_size(), 4096);
  for (float v : r[2 * kSteps].forward().logprobs(0).values()) ASSERT_TRUE(std::isfinite(v) && v <= 0);
  runner.Cancel("done");
  EXPECT_EQ(rec.Wait(absl::Seconds(60)).cancelled(), "done");
}

TEST(ProbeCapabilitiesTest, DescribesTheCpu) {
  auto caps = ProbeCapabilities("cpu");
  ASSERT_TRUE(caps.ok()) << caps.status();
  EXPECT_EQ(caps->device(), "cpu");
  EXPECT_FALSE(caps->hostname().empty());
  EXPECT_GT(caps->host_memory_bytes(), 0);
  EXPECT_FALSE(ProbeCapabilities("tpu:0").ok());
}

}  // namespace
}  // namespace odyssey::worker
