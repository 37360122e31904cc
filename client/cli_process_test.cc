// The `odyssey` CLI against a real odyssey-controller (loopback port picked at run time) with a
// fake worker: output and the exit codes a shell user relies on.
#include <sys/wait.h>

#include <filesystem>
#include <fstream>
#include <future>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/testing/controller_process.h"
#include "server/testing/fake_worker.h"

namespace odyssey::client {
namespace {

using ::odyssey::server::testing::ControllerProcess;
using ::odyssey::server::testing::FakeWorker;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr absl::Duration kWait = absl::Seconds(20);

struct CliRun {
  int code = -1;
  std::string out, err;
};

std::string Slurp(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class CliProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / absl::StrCat("odyssey_cli_proc_", getpid());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    ControllerProcess::Options o;
    o.binary = server::testing::ControllerBinaryFromEnv();
    o.state_dir = (dir_ / "state").string();
    o.work_dir = dir_.string();
    auto c = ControllerProcess::Start(o);
    ASSERT_TRUE(c.ok()) << c.status();
    controller_ = std::move(*c);
  }
  void TearDown() override {
    worker_.reset();
    controller_.reset();
    if (!HasFailure()) std::filesystem::remove_all(dir_);
  }

  // Runs the CLI with `args` (no shell metacharacters), capturing stdout/stderr.
  CliRun Cli(const std::vector<std::string>& args, bool with_controller = true) {
    static int n = 0;
    const auto out = dir_ / absl::StrCat("out", n), err = dir_ / absl::StrCat("err", n);
    ++n;
    const char* bin = std::getenv("ODYSSEY_CLI_BINARY");
    std::string cmd = absl::StrCat("'", bin ? bin : "", "' ");
    if (with_controller) absl::StrAppend(&cmd, "--controller ", controller_->address(), " ");
    absl::StrAppend(&cmd, absl::StrJoin(args, " "), " > '", out.string(), "' 2> '", err.string(), "' < /dev/null");
    const int status = std::system(cmd.c_str());
    CliRun r;
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = Slurp(out);
    r.err = Slurp(err);
    return r;
  }
  std::string WriteSpec(const std::string& name, const std::string& text) {
    const auto p = dir_ / name;
    std::ofstream(p) << text;
    return p.string();
  }
  static std::string GoodSpec(int steps = 10) {
    return absl::StrCat("model: {name: tiny}\noptimizer: {lr: 1e-3}\ndata: {format: kjv, seq_len: 64, batch_size: 1}\n",
                        "steps: ", steps, "\n");
  }

  std::filesystem::path dir_;
  std::unique_ptr<ControllerProcess> controller_;
  std::unique_ptr<FakeWorker> worker_;
};

TEST_F(CliProcessTest, SubmitListGetAndErrorsExitAsAShellExpects) {
  const std::string good = WriteSpec("good.yaml", GoodSpec());
  CliRun r = Cli({"submit", good, "--request-id", "same"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "jobs/1\n");
  r = Cli({"submit", good, "--request-id", "same"});
  EXPECT_EQ(r.code, 0);
  EXPECT_EQ(r.out, "jobs/1\n");  // idempotent

  r = Cli({"list"});
  EXPECT_EQ(r.code, 0);
  EXPECT_THAT(r.out, HasSubstr("jobs/1"));
  EXPECT_THAT(r.out, HasSubstr("PENDING"));
  r = Cli({"get", "1"});
  EXPECT_EQ(r.code, 0);
  EXPECT_THAT(r.out, HasSubstr("state:           PENDING"));
  r = Cli({"--json", "get", "jobs/1"});
  EXPECT_EQ(r.code, 0);
  EXPECT_THAT(r.out, HasSubstr("\"state\": \"PENDING\""));

  r = Cli({"submit", WriteSpec("typo.yaml", "optimizer: {lrr: 1}\n")});
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("typo.yaml: optimizer.lrr: unknown field"));
  r = Cli({"submit", WriteSpec("zero.yaml", "model: {name: tiny}\noptimizer: {lr: 0}\ndata: {seq_len: 64, batch_size: 1}\nsteps: 1\n")});
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("spec.optimizer.lr"));
  r = Cli({"submit", (dir_ / "missing.yaml").string()});
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("cannot read"));
  r = Cli({"get", "jobs/999"});
  EXPECT_EQ(r.code, 3);
  EXPECT_THAT(r.err, HasSubstr("not found"));
  r = Cli({"list", "--state", "sleeping"});
  EXPECT_EQ(r.code, 2);
  r = Cli({});
  EXPECT_EQ(r.code, 2);
  r = Cli({"--controller", "127.0.0.1:1", "--timeout", "2", "list"}, /*with_controller=*/false);
  EXPECT_EQ(r.code, 4);
  EXPECT_THAT(r.err, HasSubstr("unavailable"));
}

// `odyssey plan`: the controller's planner without a job (no GPU worker attached: an H200 host).
TEST_F(CliProcessTest, PlanShowsTheStrategyAndExitsOneWhenNothingFits) {
  auto spec = [&](const std::string& name, int64_t seq, const std::string& extra = "") {
    return WriteSpec(name, absl::StrCat("model: {name: llama-3.2-3b}\noptimizer: {lr: 1e-4}\n",
                                        "data: {format: kjv, seq_len: ", seq, ", batch_size: 1}\nsteps: 1\n", extra));
  };
  CliRun r = Cli({"plan", spec("512k.yaml", 524288), "--max-seq-len"});
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("model llama-3.2-3b, 524288 tokens x 1 per step, on an H200 host"));
  EXPECT_THAT(r.out, HasSubstr("\nfits\n"));
  EXPECT_THAT(r.out, HasSubstr("strategy: recompute=layer offload=on"));
  EXPECT_THAT(r.out, HasSubstr("optimizer state (fp32 master and moments)"));
  EXPECT_THAT(r.out, HasSubstr("longest sequence that fits (one per step): 1589248 tokens"));

  r = Cli({"plan", spec("8m.yaml", int64_t{8} << 20)});
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("does not fit: 8388608 tokens x 1 needs at least"));
  EXPECT_THAT(r.out, ::testing::Not(HasSubstr("strategy:")));

  r = Cli({"plan", spec("none.yaml", 262144,
                        "memory: {recompute: none, offload: \"off\", mlp_tile_tokens: 4096, loss_tile_tokens: 2048}\n")});
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("does not fit: the strategy needs"));
  EXPECT_THAT(r.out, HasSubstr("strategy: recompute=none offload=off mlp_tile=4096 loss_tile=2048"));

  r = Cli({"--json", "plan", spec("64k.yaml", 65536), "--gpu-bytes", "85899345920"});
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("\"hardware\": \"the request\""));
  EXPECT_THAT(r.out, HasSubstr("\"planned_gpu_bytes\": \"85899345920\""));

  r = Cli({"plan", spec("64k.yaml", 65536), "--gpu-bytes", "-5"});
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("gpu_bytes"));
  r = Cli({"plan", WriteSpec("bad.yaml", "model: {name: llama-3.2-3b}\noptimizer: {lr: 1e-4}\ndata: {seq_len: 0}\nsteps: 1\n")});
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("spec.data.seq_len"));
  r = Cli({"list"});
  EXPECT_EQ(r.code, 0);
  EXPECT_THAT(r.out, ::testing::Not(HasSubstr("jobs/")));  // planning creates nothing
}

// Global flags work after the subcommand as before it (the README's `odyssey list --json`);
// --version prints the one version line; an unknown flag is still a usage error.
TEST_F(CliProcessTest, GlobalFlagsInAnyPositionAndVersion) {
  CliRun r = Cli({"submit", WriteSpec("good.yaml", GoodSpec()), "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("\"name\": \"jobs/1\""));
  r = Cli({"list", "--json"});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("\"name\": \"jobs/1\""));
  EXPECT_THAT(r.out, Not(HasSubstr("NAME")));  // JSON, not the table
  r = Cli({"get", "1", "--json", "--timeout", "5"});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("\"state\": \"PENDING\""));
  // --controller after the subcommand is the address used.
  r = Cli({"list", "--controller", "127.0.0.1:1", "--timeout", "2"}, /*with_controller=*/false);
  EXPECT_EQ(r.code, 4) << r.out << r.err;
  r = Cli({"list", "--no-such-flag"});
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("--no-such-flag"));
  for (const std::vector<std::string>& args : {std::vector<std::string>{"--version"}, {"list", "--version"}}) {
    r = Cli(args, /*with_controller=*/false);
    EXPECT_EQ(r.code, 0) << r.err;
    EXPECT_THAT(r.out, ::testing::MatchesRegex("odyssey [0-9]+\\.[0-9]+\\.[0-9]+( \\(.+\\))?\n")) << r.out;
  }
}

// `odyssey completion bash` is a script bash sources, completing subcommands, their flags with
// the global ones, spec files and job states; `zsh` loads it through bashcompinit.
TEST_F(CliProcessTest, BashCompletionCompletesSubcommandsFlagsAndSpecFiles) {
  CliRun r = Cli({"completion", "bash"}, /*with_controller=*/false);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string script = WriteSpec("odyssey.bash", r.out);
  WriteSpec("job.yaml", GoodSpec());
  WriteSpec("job-notes.txt", "not a spec");
  // Completes the words (the last one partial) as bash's programmable completion would.
  auto complete = [&](const std::vector<std::string>& words) {
    std::string array;
    for (const std::string& w : words) absl::StrAppend(&array, " '", w, "'");
    const std::string probe = WriteSpec("probe.sh", absl::StrCat(
        "source '", script, "'\ncd '", dir_.string(), "'\nCOMP_WORDS=(", array, ")\nCOMP_CWORD=", words.size() - 1,
        "\n_odyssey\nprintf '%s\\n' \"${COMPREPLY[@]}\" | sort | tr '\\n' ' '\n"));
    const auto out = dir_ / "completion.out";
    const int status = std::system(absl::StrCat("bash '", probe, "' > '", out.string(), "' 2>&1").c_str());
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << Slurp(out);
    return Slurp(out);
  };
  EXPECT_EQ(complete({"odyssey", "li"}), "list ");
  EXPECT_EQ(complete({"odyssey", "c"}), "cancel completion ");
  EXPECT_EQ(complete({"odyssey", "list", "--j"}), "--json ");            // a global flag after the subcommand
  EXPECT_EQ(complete({"odyssey", "list", "--st"}), "--state ");
  EXPECT_EQ(complete({"odyssey", "--json", "submit", "--w"}), "--watch ");
  EXPECT_EQ(complete({"odyssey", "list", "--state", "RU"}), "RUNNING ");
  EXPECT_EQ(complete({"odyssey", "submit", "jo"}), "job.yaml ");          // spec files only
  EXPECT_EQ(complete({"odyssey", "completion", ""}), "bash zsh ");
  EXPECT_EQ(complete({"odyssey", "--controller", ""}), " ");              // a free value: nothing offered
  r = Cli({"completion", "zsh"}, /*with_controller=*/false);
  EXPECT_EQ(r.code, 0);
  EXPECT_THAT(r.out, HasSubstr("bashcompinit"));
  EXPECT_THAT(r.out, HasSubstr("complete -o filenames -F _odyssey odyssey"));
  EXPECT_EQ(Cli({"completion", "fish"}, /*with_controller=*/false).code, 2);
}

// Plan reads the model, the sequence and the memory: a spec without optimizer and steps is
// planned, while submit still refuses it naming the field.
TEST_F(CliProcessTest, PlanNeedsNoOptimizerOrSteps) {
  const std::string spec = WriteSpec("plan-only.yaml", "model: {name: tiny}\ndata: {seq_len: 64, batch_size: 1}\n");
  CliRun r = Cli({"plan", spec});
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("\nfits\n"));
  r = Cli({"submit", spec});
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("spec.optimizer.lr"));
}

TEST_F(CliProcessTest, WatchFollowsProgressAndExitsWithTheJobsOutcome) {
  worker_ = std::make_unique<FakeWorker>(controller_->address(), "w1");
  const std::string spec = WriteSpec("good.yaml", GoodSpec(10));
  CliRun r = Cli({"submit", spec});
  ASSERT_EQ(r.code, 0) << r.err;
  ASSERT_TRUE(worker_->WaitForAssignment("jobs/1", kWait));
  ASSERT_TRUE(worker_->Progress("jobs/1", 0, 5, 512, 2.25, "", 0.5));
  // Watch in the background; finish the job once it has printed the progress line.
  auto watch = std::async(std::launch::async, [&] { return Cli({"watch", "jobs/1"}); });
  ASSERT_TRUE(worker_->Progress("jobs/1", 0, 6, 512, 2.0, "", 0.5));
  ASSERT_TRUE(worker_->Result("jobs/1", 0, true, 10));
  r = watch.get();
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("SUCCEEDED"));
  EXPECT_THAT(r.out, HasSubstr("step "));
  EXPECT_THAT(r.out, HasSubstr("/10"));
  EXPECT_THAT(r.out, HasSubstr("tok/s"));
  EXPECT_THAT(r.out, HasSubstr("ETA"));

  // A failed job: watch exits 1 and says why.
  r = Cli({"submit", spec});
  ASSERT_EQ(r.out, "jobs/2\n");
  ASSERT_TRUE(worker_->WaitForAssignment("jobs/2", kWait));
  ASSERT_TRUE(worker_->Result("jobs/2", 0, false, 3));
  r = Cli({"watch", "2"});
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.out, HasSubstr("FAILED"));
  EXPECT_THAT(r.err, HasSubstr("fake failure"));

  // Cancel: RUNNING -> CANCELLED (0), again (0), a SUCCEEDED job (2), a missing one (3).
  r = Cli({"submit", spec});
  ASSERT_TRUE(worker_->WaitForAssignment("jobs/3", kWait));
  r = Cli({"cancel", "3"});
  EXPECT_EQ(r.code, 0);
  EXPECT_THAT(r.out, HasSubstr("CANCELLED"));
  EXPECT_TRUE(worker_->WaitFor([](const auto& m) { return m.cancel() == "jobs/3"; }, kWait));
  EXPECT_EQ(Cli({"cancel", "3"}).code, 0);
  r = Cli({"cancel", "1"});
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("SUCCEEDED"));
  EXPECT_EQ(Cli({"cancel", "77"}).code, 3);
  r = Cli({"watch", "3"});
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.out, HasSubstr("CANCELLED"));
}

}  // namespace
}  // namespace odyssey::client
