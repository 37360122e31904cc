// The Controller's jobs (controller.cc): request-id idempotency, cancel rules, listing,
// watching, tenant isolation and path confinement, over a fake clock and fake workers.
#include "server/controller.h"

#include <algorithm>
#include <filesystem>
#include <functional>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/paths.h"
#include "server/testing/controller_fixture.h"
#include "server/validation.h"

namespace odyssey::server {
namespace {

namespace v1 = odyssey::v1;
using ::testing::HasSubstr;
using testing::ControllerTest;
using testing::kAnon;

TEST_F(ControllerTest, SameRequestIdCreatesOneJob) {
  auto a = controller_->CreateJob(Request(1, 10, "rid-1"), kAnon);
  auto b = controller_->CreateJob(Request(1, 10, "rid-1"), kAnon);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->name(), b->name());
  auto c = controller_->CreateJob(Request(1, 10, "rid-2"), kAnon);
  EXPECT_NE(c->name(), a->name());
  // Same id, different spec: refused, naming request_id.
  auto d = controller_->CreateJob(Request(1, 11, "rid-1"), kAnon);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(d.status().message()), HasSubstr("request_id:"));
  // And it survives a restart.
  Restart();
  auto e = controller_->CreateJob(Request(1, 10, "rid-1"), kAnon);
  EXPECT_EQ(e->name(), a->name());
  EXPECT_EQ(controller_->ListJobs({}, kAnon)->jobs_size(), 2);
}

TEST_F(ControllerTest, CancelRules) {
  auto w1 = Attach("w1");
  auto running = *controller_->CreateJob(Request(1), kAnon);
  auto pending = *controller_->CreateJob(Request(1), kAnon);
  EXPECT_EQ(controller_->CancelJob(*ParseJobName(pending.name()), kAnon)->state(), v1::Job::CANCELLED);
  EXPECT_EQ(controller_->CancelJob(*ParseJobName(running.name()), kAnon)->state(), v1::Job::CANCELLED);
  EXPECT_EQ(w1.conn->Count(v1::ControllerMessage::kCancel), 1);
  // Cancelling again is a no-op; the worker stays busy until it reports.
  EXPECT_EQ(controller_->CancelJob(*ParseJobName(running.name()), kAnon)->state(), v1::Job::CANCELLED);
  auto next = *controller_->CreateJob(Request(1), kAnon);
  EXPECT_EQ(Get(next.name()).state(), v1::Job::PENDING);
  Result(w1, running.name(), 0, false, "cancel requested");
  EXPECT_EQ(Get(running.name()).state(), v1::Job::CANCELLED);
  EXPECT_EQ(Get(next.name()).state(), v1::Job::RUNNING);
  Result(w1, next.name(), 0, true);
  auto done = controller_->CancelJob(*ParseJobName(next.name()), kAnon);
  EXPECT_EQ(done.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(done.status().message()), HasSubstr("SUCCEEDED"));
  EXPECT_EQ(controller_->CancelJob(12345, kAnon).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ControllerTest, ListJobsPagesNewestFirst) {
  for (int i = 0; i < 7; ++i) ASSERT_TRUE(controller_->CreateJob(Request(1), kAnon).ok());
  v1::ListJobsRequest r;
  r.set_page_size(3);
  std::vector<std::string> names;
  while (true) {
    auto page = controller_->ListJobs(r, kAnon);
    ASSERT_TRUE(page.ok());
    for (const auto& j : page->jobs()) names.push_back(j.name());
    if (page->next_page_token().empty()) break;
    r.set_page_token(page->next_page_token());
  }
  ASSERT_EQ(names.size(), 7u);
  EXPECT_EQ(names.front(), "jobs/7");
  EXPECT_EQ(names.back(), "jobs/1");
  v1::ListJobsRequest filtered;
  filtered.set_state(v1::Job::RUNNING);
  EXPECT_EQ(controller_->ListJobs(filtered, kAnon)->jobs_size(), 0);
}

TEST_F(ControllerTest, WatchDeliversStateStepsAndEnd) {
  auto w1 = Attach("w1");
  auto job = *controller_->CreateJob(Request(1), kAnon);
  auto watch = *controller_->WatchJob(*ParseJobName(job.name()), kAnon);
  Progress(w1, job.name(), 0, 1, "/ckpt/1");
  Result(w1, job.name(), 0, true);
  std::vector<v1::JobEvent> events;
  while (auto e = watch->Next(absl::Seconds(1))) events.push_back(*e);
  EXPECT_TRUE(watch->done());
  ASSERT_GE(events.size(), 4u);
  EXPECT_EQ(events.front().state(), v1::Job::RUNNING);
  EXPECT_TRUE(std::any_of(events.begin(), events.end(), [](auto& e) { return e.has_step(); }));
  EXPECT_TRUE(std::any_of(events.begin(), events.end(), [](auto& e) { return e.checkpoint() == "/ckpt/1"; }));
  EXPECT_EQ(events.back().state(), v1::Job::SUCCEEDED);
}

// ListJobEvents pages through every recorded step in order, also after a restart, and keeps
// other tenants out.
TEST_F(ControllerTest, ListJobEventsPagesTheHistoryInOrder) {
  auto w1 = Attach("w1");
  auto job = *controller_->CreateJob(Request(1, 5), kAnon);
  const int64_t id = *ParseJobName(job.name());
  for (int64_t step = 1; step <= 5; ++step) Progress(w1, job.name(), 0, step);
  Result(w1, job.name(), 0, true);
  Restart();  // the history is the store's
  auto read_all = [&](int32_t page_size) {
    std::vector<int64_t> steps;
    int pages = 0;
    v1::ListJobEventsRequest r;
    r.set_name(job.name());
    r.set_page_size(page_size);
    while (true) {
      auto page = controller_->ListJobEvents(id, r, kAnon);
      EXPECT_TRUE(page.ok()) << page.status();
      if (!page.ok()) break;
      ++pages;
      for (const v1::JobEvent& e : page->events()) {
        EXPECT_EQ(e.job(), job.name());
        if (e.has_step()) steps.push_back(e.step().step());
      }
      if (page->next_page_token().empty()) break;
      r.set_page_token(page->next_page_token());
    }
    return std::make_pair(steps, pages);
  };
  const auto [steps, pages] = read_all(2);
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3, 4, 5}));
  EXPECT_GE(pages, 4);  // 5 steps + state changes, 2 a page
  EXPECT_EQ(read_all(0).first, steps);
  EXPECT_EQ(read_all(0).second, 1);
  v1::ListJobEventsRequest r;
  EXPECT_EQ(controller_->ListJobEvents(id, r, "mallory").status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(controller_->ListJobEvents(id + 1, r, kAnon).status().code(), absl::StatusCode::kNotFound);
}

// ---------------------------------------------------------------------------------------------
// Tenants (auth on): each tenant sees and touches only its own jobs.

TEST_F(ControllerTest, CreateJobRecordsTheTenantAndItSurvivesARestart) {
  auto job = controller_->CreateJob(Request(1), "alice");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->tenant(), "alice");
  Restart();
  auto again = controller_->GetJob(*ParseJobName(job->name()), "alice");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->tenant(), "alice");
  EXPECT_EQ(controller_->GetJob(*ParseJobName(job->name()), "bob").status().code(),
            absl::StatusCode::kPermissionDenied);
}

TEST_F(ControllerTest, ListJobsShowsOnlyTheCallersJobs) {
  std::vector<std::string> alice, bob;
  for (int i = 0; i < 5; ++i) {
    alice.push_back(controller_->CreateJob(Request(1), "alice")->name());
    bob.push_back(controller_->CreateJob(Request(1), "bob")->name());
  }
  const std::string anonymous = controller_->CreateJob(Request(1), kAnon)->name();
  auto names = [&](const std::string& tenant, int page_size) {
    std::vector<std::string> out;
    v1::ListJobsRequest r;
    r.set_page_size(page_size);
    while (true) {
      auto page = controller_->ListJobs(r, tenant);
      EXPECT_TRUE(page.ok()) << page.status();
      for (const auto& j : page->jobs()) {
        EXPECT_EQ(j.tenant(), tenant) << j.name();
        out.push_back(j.name());
      }
      if (page->next_page_token().empty()) break;
      r.set_page_token(page->next_page_token());
    }
    std::reverse(out.begin(), out.end());  // oldest first, as created
    return out;
  };
  EXPECT_EQ(names("alice", 2), alice);  // pages of 2 over interleaved ids
  EXPECT_EQ(names("bob", 0), bob);
  EXPECT_EQ(names(kAnon, 0), std::vector<std::string>{anonymous});
  EXPECT_TRUE(names("carol", 0).empty());
  Restart();
  EXPECT_EQ(names("alice", 3), alice);
}

TEST_F(ControllerTest, AnotherTenantsJobIsPermissionDenied) {
  auto w1 = Attach("w1");
  const v1::Job job = *controller_->CreateJob(Request(1), "alice");
  const int64_t id = *ParseJobName(job.name());
  ASSERT_EQ(job.state(), v1::Job::RUNNING);
  const std::string want = "name: " + job.name() + " belongs to another tenant";
  for (const std::string& other : {std::string("bob"), kAnon}) {
    auto get = controller_->GetJob(id, other);
    EXPECT_EQ(get.status().code(), absl::StatusCode::kPermissionDenied);
    EXPECT_EQ(get.status().message(), want);
    auto cancel = controller_->CancelJob(id, other);
    EXPECT_EQ(cancel.status().code(), absl::StatusCode::kPermissionDenied);
    EXPECT_EQ(cancel.status().message(), want);
    auto watch = controller_->WatchJob(id, other);
    EXPECT_EQ(watch.status().code(), absl::StatusCode::kPermissionDenied);
    EXPECT_EQ(watch.status().message(), want);
    absl::Status access = controller_->CheckJobAccess(id, other);
    EXPECT_EQ(access.code(), absl::StatusCode::kPermissionDenied);
    EXPECT_EQ(access.message(), want);
  }
  // The refused cancels did nothing: the job still runs and its worker got no cancel.
  EXPECT_EQ(controller_->GetJob(id, "alice")->state(), v1::Job::RUNNING);
  EXPECT_EQ(w1.conn->Count(v1::ControllerMessage::kCancel), 0);
  // The owner may do all of it.
  EXPECT_TRUE(controller_->CheckJobAccess(id, "alice").ok());
  EXPECT_TRUE(controller_->WatchJob(id, "alice").ok());
  EXPECT_EQ(controller_->CancelJob(id, "alice")->state(), v1::Job::CANCELLED);
  // A job that does not exist is NOT_FOUND for everyone.
  EXPECT_EQ(controller_->CheckJobAccess(9999, "alice").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(controller_->GetJob(9999, "bob").status().code(), absl::StatusCode::kNotFound);
}

// --path-root: a root with alice's and bob's folders and a shared read root (base models).
class PathConfinementTest : public ControllerTest {
 protected:
  void SetUp() override {
    ControllerTest::SetUp();
    root_ = (dir_ / "root").string();
    shared_ = (dir_ / "shared").string();
    for (const std::string& d : {root_ + "/alice/base", root_ + "/bob/export", shared_ + "/base"}) {
      std::filesystem::create_directories(d);
    }
    auto policy = PathPolicy::Create({.root = root_, .shared_read_roots = {shared_}});
    ASSERT_TRUE(policy.ok()) << policy.status();
    paths_ = *policy;
    Restart();
  }
  absl::Status Create(const std::string& tenant, const std::function<void(v1::JobSpec&)>& edit) {
    v1::CreateJobRequest r = Request(1);
    edit(*r.mutable_spec());
    return controller_->CreateJob(r, tenant).status();
  }
  std::string root_, shared_;
};

TEST_F(PathConfinementTest, JobSpecPathsMustBeTheTenantsOrShared) {
  struct Case {
    std::function<void(v1::JobSpec&)> edit;
    absl::StatusCode code;
    std::string message;  // expected prefix
  };
  const auto kDenied = absl::StatusCode::kPermissionDenied;
  const Case cases[] = {
      {[&](v1::JobSpec& s) { s.mutable_checkpoint()->set_directory(root_ + "/alice/run1"); }, absl::StatusCode::kOk, ""},
      {[&](v1::JobSpec& s) { s.mutable_model()->set_name(shared_ + "/base"); }, absl::StatusCode::kOk, ""},
      {[&](v1::JobSpec& s) { s.mutable_data()->set_path(shared_ + "/data.bin"); }, absl::StatusCode::kOk, ""},
      {[&](v1::JobSpec& s) { s.mutable_checkpoint()->set_directory(root_ + "/bob/run1"); }, kDenied,
       "spec.checkpoint.directory: \"" + root_ + "/bob/run1\" must be inside " + root_ +
           "/alice (the caller's tenant folder)"},
      {[&](v1::JobSpec& s) { s.mutable_checkpoint()->set_directory(shared_ + "/base/out"); }, kDenied,
       "spec.checkpoint.directory: "},
      {[&](v1::JobSpec& s) { s.mutable_model()->set_name(root_ + "/bob/export"); }, kDenied,
       "spec.model.name: \"" + root_ + "/bob/export\" must be under " + root_ + "/alice (the caller's tenant folder) or " +
           shared_ + " (shared, read-only)"},
      {[&](v1::JobSpec& s) { s.mutable_model()->set_name(root_ + "/alice/../bob/export"); }, kDenied, "spec.model.name: "},
      {[&](v1::JobSpec& s) { s.mutable_data()->set_path("/etc/passwd"); }, kDenied, "spec.data.path: \"/etc/passwd\""},
      {[&](v1::JobSpec& s) { s.mutable_data()->set_path("data.bin"); }, absl::StatusCode::kInvalidArgument,
       "spec.data.path: \"data.bin\" must be an absolute path"},
      {[&](v1::JobSpec& s) { s.mutable_model()->set_name("some-folder"); }, absl::StatusCode::kInvalidArgument,
       "spec.model.name: \"some-folder\" must be a named shape"},
  };
  for (const Case& c : cases) {
    const absl::Status s = Create("alice", c.edit);
    EXPECT_EQ(s.code(), c.code) << s;
    EXPECT_THAT(std::string(s.message()), ::testing::StartsWith(c.message));
  }
  // Bob's own folder is his; the anonymous tenant (auth off) may use the whole root.
  EXPECT_TRUE(Create("bob", [&](v1::JobSpec& s) { s.mutable_model()->set_name(root_ + "/bob/export"); }).ok());
  EXPECT_TRUE(Create(kAnon, [&](v1::JobSpec& s) { s.mutable_model()->set_name(root_ + "/bob/export"); }).ok());
  EXPECT_EQ(Create(kAnon, [&](v1::JobSpec& s) { s.mutable_data()->set_path("/etc/passwd"); }).code(), kDenied);
}

TEST_F(PathConfinementTest, DefaultCheckpointsGoToTheTenantFolder) {
  auto w1 = Attach("w1");
  const v1::Job job = *controller_->CreateJob(Request(1), "alice");
  ASSERT_EQ(w1.conn->Assignments().size(), 1u);
  EXPECT_EQ(w1.conn->Assignments()[0].checkpoint_dir(), root_ + "/alice/checkpoints/job-" +
                                                             std::to_string(*ParseJobName(job.name())));
  EXPECT_EQ(controller_->DefaultCheckpointDir(7, kAnon), root_ + "/checkpoints/job-7");
}

TEST_F(PathConfinementTest, ALinkCannotSteerTheDefaultCheckpointFolder) {
  std::filesystem::create_directory_symlink(root_ + "/bob", root_ + "/alice/checkpoints");
  const absl::Status s = Create("alice", [](v1::JobSpec&) {});
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_THAT(s.message(), HasSubstr("resolves (through a symbolic link) outside"));
}

TEST_F(PathConfinementTest, JobsStoredBeforeThePathRootFailWhenTheyStart) {
  // Bob's job was accepted by a controller without --path-root; the store keeps it PENDING.
  paths_ = PathPolicy();
  Restart();
  v1::CreateJobRequest r = Request(1);
  r.mutable_spec()->mutable_model()->set_name(root_ + "/alice/base");
  const std::string stolen = controller_->CreateJob(r, "bob")->name();
  const std::string fine = controller_->CreateJob(Request(1), "bob")->name();
  // The controller restarts with --path-root: the job fails when it would start, and its
  // worker takes the next one.
  paths_ = *PathPolicy::Create({.root = root_, .shared_read_roots = {shared_}});
  Restart();
  auto w1 = Attach("w1");
  const v1::Job failed = *controller_->GetJob(*ParseJobName(stolen), "bob");
  EXPECT_EQ(failed.state(), v1::Job::FAILED);
  EXPECT_THAT(failed.error(), HasSubstr("refused when starting (--path-root): spec.model.name: "));
  EXPECT_EQ(controller_->GetJob(*ParseJobName(fine), "bob")->state(), v1::Job::RUNNING);
  ASSERT_EQ(w1.conn->Assignments().size(), 1u);
  EXPECT_EQ(w1.conn->Assignments()[0].job(), fine);
}

TEST_F(PathConfinementTest, TrainingCallDirectories) {
  auto call = [](int kind, const std::string& dir) {
    v1::TrainingCall c;
    if (kind == 0) c.mutable_save_checkpoint()->set_directory(dir);
    if (kind == 1) c.mutable_load_checkpoint()->set_directory(dir);
    if (kind == 2) c.mutable_export_weights()->set_directory(dir);
    return c;
  };
  const auto kDenied = absl::StatusCode::kPermissionDenied;
  EXPECT_TRUE(controller_->CheckPaths(call(0, ""), "bob").ok());  // the job's default folder
  EXPECT_TRUE(controller_->CheckPaths(call(0, root_ + "/bob/ckpt"), "bob").ok());
  EXPECT_TRUE(controller_->CheckPaths(call(1, root_ + "/bob/export"), "bob").ok());
  EXPECT_TRUE(controller_->CheckPaths(call(1, shared_ + "/base"), "bob").ok());
  EXPECT_TRUE(controller_->CheckPaths(call(2, root_ + "/bob/export"), "bob").ok());
  const absl::Status load = controller_->CheckPaths(call(1, root_ + "/alice/base"), "bob");
  EXPECT_EQ(load.code(), kDenied);
  EXPECT_THAT(std::string(load.message()), ::testing::StartsWith("directory: \"" + root_ + "/alice/base\" must be under " + root_ +
                                                    "/bob (the caller's tenant folder)"));
  EXPECT_EQ(controller_->CheckPaths(call(0, root_ + "/alice/x"), "bob").code(), kDenied);
  EXPECT_EQ(controller_->CheckPaths(call(2, shared_ + "/base"), "bob").code(), kDenied);
  EXPECT_EQ(controller_->CheckPaths(call(2, "relative"), "bob").code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ControllerTest, WithoutAPathRootAnyAbsolutePathIsAllowed) {
  v1::CreateJobRequest r = Request(1);
  r.mutable_spec()->mutable_checkpoint()->set_directory((dir_ / "anywhere").string());
  EXPECT_TRUE(controller_->CreateJob(r, "alice").ok());
  v1::TrainingCall c;
  c.mutable_load_checkpoint()->set_directory("/somewhere/else");
  EXPECT_TRUE(controller_->CheckPaths(c, "bob").ok());
  EXPECT_EQ(controller_->DefaultCheckpointDir(3, "alice"), (dir_ / "ckpt").string() + "/job-3");
}

// A checkpoint folder serves one live job: naming the folder of a PENDING or RUNNING job (its
// directory or its default folder, however spelled) is refused naming the folder and the job,
// another tenant's job unnamed; once the job ended the folder may be named again (the workers
// then refuse it while it holds the job's steps: worker/checkpoint_folder.h). Every assignment
// says whose the steps are: "<store id>/jobs/N", the same after a restart.
TEST_F(ControllerTest, ACheckpointFolderInUseByALiveJobIsRefused) {
  auto w1 = Attach("w1");
  const std::string folder = (dir_ / "runs" / "a").string();
  v1::CreateJobRequest first = Request(1, 10, "rid-a");
  first.mutable_spec()->mutable_checkpoint()->set_directory(folder);
  const v1::Job running = *controller_->CreateJob(first, kAnon);
  ASSERT_EQ(w1.conn->Assignments().size(), 1u);
  const v1::Assignment assigned = w1.conn->Assignments()[0];
  EXPECT_EQ(assigned.checkpoint_dir(), folder);
  EXPECT_THAT(assigned.checkpoint_owner(), ::testing::MatchesRegex("[0-9a-f]{32}/" + running.name()));
  // A retry of the same request is the same job, not a second user of its folder.
  EXPECT_EQ(controller_->CreateJob(first, kAnon)->name(), running.name());

  auto with_dir = [&](const std::string& dir) {
    v1::CreateJobRequest r = Request(1);
    r.mutable_spec()->mutable_checkpoint()->set_directory(dir);
    return r;
  };
  for (const std::string& spelling : {folder, folder + "/", (dir_ / "runs" / "." / "a").string(),
                                      (dir_ / "runs" / "b" / ".." / "a").string()}) {
    auto refused = controller_->CreateJob(with_dir(spelling), kAnon);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << spelling;
    EXPECT_THAT(std::string(refused.status().message()),
                ::testing::StartsWith("spec.checkpoint.directory: \"" + spelling + "\" is in use by " + running.name() +
                                      " (RUNNING)"));
  }
  auto bobs = controller_->CreateJob(with_dir(folder), "bob");
  EXPECT_EQ(bobs.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(bobs.status().message()), HasSubstr("is in use by another tenant's job (RUNNING)"));
  EXPECT_THAT(std::string(bobs.status().message()), ::testing::Not(HasSubstr(running.name())));
  // A queued job's default folder is taken as well.
  const v1::Job pending = *controller_->CreateJob(Request(1), kAnon);
  const std::string pending_default = controller_->DefaultCheckpointDir(*ParseJobName(pending.name()), kAnon);
  auto taken = controller_->CreateJob(with_dir(pending_default), kAnon);
  EXPECT_EQ(taken.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(taken.status().message()), HasSubstr("in use by " + pending.name() + " (PENDING)"));
  EXPECT_TRUE(controller_->CreateJob(with_dir((dir_ / "runs" / "other").string()), kAnon).ok());

  Result(w1, running.name(), 0, true);
  EXPECT_EQ(Get(running.name()).state(), v1::Job::SUCCEEDED);
  EXPECT_TRUE(controller_->CreateJob(with_dir(folder), kAnon).ok());
  Restart();  // the same store: the same owner for the same job
  auto w2 = Attach("w2");
  ASSERT_FALSE(w2.conn->Assignments().empty());
  const v1::Assignment next = w2.conn->Assignments()[0];
  EXPECT_EQ(next.checkpoint_owner().substr(0, 33), assigned.checkpoint_owner().substr(0, 33));
  EXPECT_EQ(next.checkpoint_owner().substr(33), next.job());
}

TEST_F(ControllerTest, RequestIdsArePerTenant) {
  auto a1 = controller_->CreateJob(Request(1, 10, "same-id"), "alice");
  auto b1 = controller_->CreateJob(Request(1, 10, "same-id"), "bob");
  ASSERT_TRUE(a1.ok() && b1.ok());
  EXPECT_NE(a1->name(), b1->name());  // bob's retry key does not return alice's job
  EXPECT_EQ(b1->tenant(), "bob");
  // Bob may even send a different spec under the same id as alice.
  auto b2 = controller_->CreateJob(Request(1, 11, "other-id"), "bob");
  auto a2 = controller_->CreateJob(Request(1, 12, "other-id"), "alice");
  ASSERT_TRUE(a2.ok() && b2.ok());
  // Within a tenant the id is still idempotent, also across a restart.
  Restart();
  auto a3 = controller_->CreateJob(Request(1, 10, "same-id"), "alice");
  auto b3 = controller_->CreateJob(Request(1, 10, "same-id"), "bob");
  ASSERT_TRUE(a3.ok() && b3.ok());
  EXPECT_EQ(a3->name(), a1->name());
  EXPECT_EQ(b3->name(), b1->name());
  auto clash = controller_->CreateJob(Request(1, 13, "same-id"), "bob");
  EXPECT_EQ(clash.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(controller_->ListJobs({}, "alice")->jobs_size(), 2);
  EXPECT_EQ(controller_->ListJobs({}, "bob")->jobs_size(), 2);
}

}  // namespace
}  // namespace odyssey::server
