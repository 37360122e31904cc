// One planning rule: for a table of JobSpecs (memory fields set and unset, both dtypes, host
// budgets, batch sizes) on the machines a controller plans for, CreateJob accepts exactly the
// specs PlannerService.Plan says fit, and refuses the others with the same reason.
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/registry.h"
#include "server/auth.h"
#include "server/controller.h"

namespace odyssey::server {
namespace {

namespace v1 = odyssey::v1;

class NullConnection : public WorkerConnection {
 public:
  void Send(const v1::ControllerMessage&) override {}
  void Close() override {}
};

struct Row {
  std::string what;
  int64_t seq_len;
  int64_t batch_size = 1;
  std::string dtype;
  std::function<void(v1::MemorySpec&)> memory = [](v1::MemorySpec&) {};
};

std::vector<Row> Table() {
  std::vector<Row> rows;
  for (const char* dtype : {"", "bfloat16", "float32"}) {
    for (int64_t seq : {int64_t{65536}, int64_t{262144}, int64_t{786432}, int64_t{1} << 20, int64_t{3} << 20}) {
      rows.push_back({"planner's choice", seq, 1, dtype});
      rows.push_back({"recompute layer, offload off", seq, 1, dtype, [](v1::MemorySpec& m) {
                        m.set_recompute("layer");
                        m.set_offload("off");
                      }});
      rows.push_back({"host budget 16 GiB", seq, 1, dtype,
                      [](v1::MemorySpec& m) { m.set_host_budget_bytes(int64_t{16} << 30); }});
      rows.push_back({"the old 'all set' four: no recompute, untiled-ish", seq, 1, dtype, [](v1::MemorySpec& m) {
                        m.set_recompute("none");
                        m.set_offload("off");
                        m.set_mlp_tile_tokens(4096);
                        m.set_loss_tile_tokens(2048);
                      }});
      rows.push_back({"every field set", seq, 1, dtype, [](v1::MemorySpec& m) {
                        m.set_recompute("layer");
                        m.set_recompute_every_k(2);
                        m.set_offload("on");
                        m.set_device_resident(4);
                        m.set_mlp_tile_tokens(8192);
                        m.set_loss_tile_tokens(2048);
                        m.set_attention_head_groups(4);
                        m.set_keep_attention(false);
                        m.set_optimizer_on_host(false);
                        m.set_keep_selection(false);
                      }});
      rows.push_back({"optimizer on host, head groups 2", seq, 1, dtype, [](v1::MemorySpec& m) {
                        m.set_optimizer_on_host(true);
                        m.set_attention_head_groups(2);
                      }});
    }
    for (int64_t batch : {int64_t{4}, int64_t{16}, int64_t{64}}) {
      rows.push_back({"batch of 8K rows", 8192, batch, dtype});
    }
  }
  return rows;
}

class AdmissionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("odyssey_admission_test_" + std::to_string(getpid()));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    auto store = JobStore::Open((dir_ / "c.db").string());
    ASSERT_TRUE(store.ok()) << store.status();
    ControllerOptions options;
    options.checkpoint_root = (dir_ / "ckpt").string();
    options.registry = std::make_shared<prometheus::Registry>();
    auto c = Controller::Create(options, std::move(*store));
    ASSERT_TRUE(c.ok()) << c.status();
    controller_ = std::move(*c);
  }
  void TearDown() override {
    controller_.reset();
    std::filesystem::remove_all(dir_);
  }
  void AttachGpu(const std::string& id, int64_t device_bytes, int64_t host_bytes) {
    v1::WorkerCapabilities caps;
    caps.set_worker_id(id);
    caps.set_device("cuda:0");
    caps.set_device_memory_bytes(device_bytes);
    caps.set_host_memory_bytes(host_bytes);
    absl::StatusOr<int64_t> session = controller_->AttachWorker(caps, "127.0.0.1", std::make_shared<NullConnection>());
    ASSERT_TRUE(session.ok());
    v1::WorkerMessage held;  // a fresh worker's empty `held`
    held.mutable_held();
    controller_->OnWorkerMessage(*session, held);
  }
  // Runs the table; returns how many rows fit (so a caller can check the table is not one-sided).
  int CheckTable(const std::string& machine) {
    int fits = 0, refused = 0, n = 0;
    for (const Row& row : Table()) {
      v1::CreateJobRequest create;
      v1::JobSpec* spec = create.mutable_spec();
      spec->mutable_model()->set_name("llama-3.2-3b");
      spec->mutable_model()->set_dtype(row.dtype);
      spec->mutable_optimizer()->set_lr(1e-4);
      spec->mutable_data()->set_seq_len(row.seq_len);
      spec->mutable_data()->set_batch_size(row.batch_size);
      spec->set_steps(1);
      row.memory(*spec->mutable_memory());
      create.set_request_id(absl::StrCat(machine, "-", n++));
      SCOPED_TRACE(testing::Message() << machine << ": " << row.what << ", " << row.seq_len << " x " << row.batch_size
                                      << ", dtype '" << row.dtype << "'");
      v1::PlanRequest plan_request;
      *plan_request.mutable_spec() = *spec;
      absl::StatusOr<v1::PlanResponse> plan = controller_->Plan(plan_request);
      absl::StatusOr<v1::Job> job = controller_->CreateJob(create, kAnonymousTenant);
      if (!plan.ok()) {  // fields the model cannot take: both refuse alike
        EXPECT_EQ(job.status().code(), plan.status().code());
        EXPECT_EQ(job.status().message(), plan.status().message());
        ++refused;
        continue;
      }
      EXPECT_EQ(job.ok(), plan->fits()) << plan->message() << " | " << job.status();
      if (plan->fits()) {
        ++fits;
        EXPECT_TRUE(plan->message().empty()) << plan->message();
      } else {
        ++refused;
        EXPECT_EQ(job.status().code(), absl::StatusCode::kFailedPrecondition);
        EXPECT_THAT(std::string(job.status().message()), ::testing::HasSubstr(plan->message()));
      }
    }
    EXPECT_GT(refused, 0) << "the table must have rows that do not fit on " << machine;
    return fits;
  }

  std::filesystem::path dir_;
  std::unique_ptr<Controller> controller_;
};

TEST_F(AdmissionTest, CreateJobAcceptsExactlyWhatPlanSaysFitsOnAnH200Host) {
  EXPECT_GT(CheckTable("h200-default"), 10);
}

TEST_F(AdmissionTest, CreateJobAcceptsExactlyWhatPlanSaysFitsOnAttachedGpus) {
  AttachGpu("gpu-80", int64_t{80} << 30, int64_t{64} << 30);
  EXPECT_GT(CheckTable("80g"), 5);
  AttachGpu("gpu-141", int64_t{141} << 30, int64_t{256} << 30);  // the largest GPU is planned for
  EXPECT_GT(CheckTable("141g"), 10);
}

}  // namespace
}  // namespace odyssey::server
