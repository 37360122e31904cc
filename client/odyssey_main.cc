// odyssey: the command-line client of odyssey-controller's JobService.
//
//   odyssey [--controller HOST:PORT] [--tls-ca PEM] [--token-file PATH] submit SPEC.yaml [--request-id ID] [--watch]
//   odyssey list [--state RUNNING] [--page-size N] [--all]
//   odyssey get JOB        odyssey watch JOB        odyssey cancel JOB
//   odyssey plan SPEC.yaml [--gpu-bytes N] [--host-bytes N] [--max-seq-len]
//   odyssey plot JOB [-o FILE.png]   (--json: the events as JSON lines instead)
//   odyssey completion bash|zsh      odyssey --version
//
// Global flags (--controller, --timeout, --json, --tls-*, --token-file) may come before or
// after the subcommand (`odyssey list --json` and `odyssey --json list` are the same).
// `completion bash` prints a bash completion script built from these definitions
// (`source <(odyssey completion bash)`; zsh: `odyssey completion zsh`, through bashcompinit).
//
// `plot` reads every event the controller recorded for the job (ListJobEvents) and hands them,
// as JSON lines, to `python3 -m odyssey_client.plot` (ODYSSEY_PYTHON picks the interpreter),
// which draws loss, tokens/s and GPU memory over the steps into a PNG with matplotlib.
//
// `plan` asks the controller's planner what the spec would need per GPU rank (the strategy,
// the predicted GPU and pinned host peaks term by term, on the attached workers' largest GPU
// unless --gpu-bytes says otherwise) without creating a job; exit 0 when it fits, 1 when not.
//
// JOB is "jobs/N" or N. Exit codes: 0 ok; 1 the job FAILED or was CANCELLED (watch, submit
// --watch) or another error; 2 usage or invalid argument (bad flags, bad spec file,
// INVALID_ARGUMENT, FAILED_PRECONDITION, ...); 3 not found; 4 controller unavailable;
// 5 not allowed (UNAUTHENTICATED: no or unknown token; PERMISSION_DENIED: another tenant's job
// or a path outside the caller's folders).
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <random>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/strings/ascii.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/spec.h"
#include "common/tls.h"
#include "common/version.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/grpcpp.h"
#include "odyssey/v1/odyssey.grpc.pb.h"

namespace {

namespace v1 = odyssey::v1;

constexpr int kExitOk = 0;
constexpr int kExitJobFailed = 1;
constexpr int kExitUsage = 2;
constexpr int kExitNotFound = 3;
constexpr int kExitUnavailable = 4;
constexpr int kExitNotAllowed = 5;

int ExitCodeFor(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return kExitOk;
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::OUT_OF_RANGE:
    case grpc::StatusCode::ALREADY_EXISTS:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
    case grpc::StatusCode::UNIMPLEMENTED:
      return kExitUsage;
    case grpc::StatusCode::NOT_FOUND:
      return kExitNotFound;
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return kExitUnavailable;
    case grpc::StatusCode::UNAUTHENTICATED:
    case grpc::StatusCode::PERMISSION_DENIED:
      return kExitNotAllowed;
    default:
      return kExitJobFailed;
  }
}

const char* CodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::INVALID_ARGUMENT: return "invalid argument";
    case grpc::StatusCode::FAILED_PRECONDITION: return "failed precondition";
    case grpc::StatusCode::NOT_FOUND: return "not found";
    case grpc::StatusCode::UNAVAILABLE: return "unavailable";
    case grpc::StatusCode::DEADLINE_EXCEEDED: return "deadline exceeded";
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return "resource exhausted";
    case grpc::StatusCode::UNIMPLEMENTED: return "unimplemented";
    case grpc::StatusCode::UNAUTHENTICATED: return "unauthenticated";
    case grpc::StatusCode::PERMISSION_DENIED: return "permission denied";
    default: return "error";
  }
}

int Fail(const std::string& controller, const grpc::Status& status) {
  std::cerr << "odyssey: " << CodeName(status.error_code()) << ": " << status.error_message();
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
    std::cerr << " (controller " << controller << "; set --controller or ODYSSEY_CONTROLLER";
    std::cerr << "; a TLS controller needs --tls-ca)";
  }
  if (status.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
    std::cerr << " (set --token-file or ODYSSEY_TOKEN)";
  }
  std::cerr << "\n";
  return ExitCodeFor(status.error_code());
}

std::string JobName(const std::string& arg) {
  int64_t id = 0;
  if (absl::SimpleAtoi(arg, &id)) return absl::StrCat("jobs/", id);
  return arg;
}

std::string Lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string FormatTime(const google::protobuf::Timestamp& t) {
  if (t.seconds() == 0 && t.nanos() == 0) return "-";
  return absl::FormatTime("%Y-%m-%d %H:%M:%S", absl::FromUnixSeconds(t.seconds()), absl::LocalTimeZone());
}

std::string FormatRate(double tokens_per_second) {
  if (tokens_per_second >= 1e6) return absl::StrFormat("%.2fM", tokens_per_second / 1e6);
  if (tokens_per_second >= 1e3) return absl::StrFormat("%.1fK", tokens_per_second / 1e3);
  return absl::StrFormat("%.0f", tokens_per_second);
}

std::string FormatDuration(double seconds) {
  if (seconds < 0 || !std::isfinite(seconds)) return "?";
  int64_t s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return absl::StrFormat("%dh%02dm", s / 3600, (s % 3600) / 60);
  if (s >= 60) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrFormat("%ds", s);
}

std::string ToJson(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, options);
  return out;
}

void PrintJob(const v1::Job& job) {
  std::cout << "name:            " << job.name() << "\n"
            << "display_name:    " << job.spec().display_name() << "\n"
            << "state:           " << v1::Job::State_Name(job.state()) << "\n"
            << "model:           " << job.spec().model().name() << "\n"
            << "world_size:      " << std::max(1, job.spec().parallel().world_size()) << "\n"
            << "kind:            " << (job.spec().kind() == v1::RL_SESSION ? "RL_SESSION" : "SFT") << "\n"
            << "step:            "
            << (job.spec().kind() == v1::RL_SESSION ? absl::StrCat(job.step(), " (optimizer steps of the session)")
                                                     : absl::StrCat(job.step(), " / ", job.spec().steps()))
            << "\n"
            << "loss:            " << absl::StrFormat("%.4f", job.loss()) << "\n"
            << "tokens/s:        " << FormatRate(job.tokens_per_second()) << "\n"
            << "restarts:        " << job.restarts() << " (limit " << job.spec().restart_limit() << ")"
            << (job.rendezvous_retries() > 0
                    ? absl::StrCat("; ", job.rendezvous_retries(), " rendezvous retries (the ranks did not meet)")
                    : "")
            << "\n"
            << "workers:         ";
  for (int i = 0; i < job.workers_size(); ++i) std::cout << (i ? "," : "") << job.workers(i);
  std::cout << "\n"
            << "last_checkpoint: " << job.last_checkpoint() << "\n"
            << (job.spec().resume_from().empty() ? "" : "resume_from:     " + job.spec().resume_from() + "\n")
            << "created:         " << FormatTime(job.create_time()) << "\n"
            << "started:         " << FormatTime(job.start_time()) << "\n"
            << "ended:           " << FormatTime(job.end_time()) << "\n";
  if (!job.error().empty()) std::cout << "error:           " << job.error() << "\n";
  if (!job.pending_reason().empty()) {
    std::cout << "waiting:         " << job.pending_reason() << (job.beyond_fleet() ? " [beyond the fleet]" : "")
              << "\n";
  }
}

class Client {
 public:
  // `args` carries the TLS target-name override, if any. `token` empty = no authorization.
  Client(std::string address, double timeout_s, std::shared_ptr<grpc::ChannelCredentials> credentials,
         grpc::ChannelArguments args, std::string token)
      : address_(std::move(address)), timeout_s_(timeout_s), token_(std::move(token)) {
    args.SetMaxReceiveMessageSize(64 << 20);
    auto channel = grpc::CreateCustomChannel(address_, credentials, args);
    stub_ = v1::JobService::NewStub(channel);
    planner_ = v1::PlannerService::NewStub(channel);
  }
  const std::string& address() const { return address_; }
  v1::JobService::Stub* stub() { return stub_.get(); }
  v1::PlannerService::Stub* planner() { return planner_.get(); }
  // A unary call: deadline and token.
  void Prepare(grpc::ClientContext* ctx) {
    ctx->set_deadline(std::chrono::system_clock::now() +
                      std::chrono::milliseconds(static_cast<int64_t>(timeout_s_ * 1000)));
    Authorize(ctx);
  }
  // A stream (no deadline): the token only.
  void Authorize(grpc::ClientContext* ctx) { odyssey::AddBearerToken(token_, ctx); }

 private:
  std::string address_;
  double timeout_s_;
  std::string token_;
  std::unique_ptr<v1::JobService::Stub> stub_;
  std::unique_ptr<v1::PlannerService::Stub> planner_;
};

std::string GiB(int64_t bytes) { return absl::StrFormat("%.1f GiB", static_cast<double>(bytes) / (1 << 30)); }

void PrintStrategy(const v1::PlanResponse& p);

// The plan as a person reads it: verdict, strategy, peaks against the machine, the terms.
void PrintPlan(const v1::JobSpec& spec, const v1::PlanResponse& p) {
  std::cout << absl::StrFormat("model %s, %d tokens x %d per step, on %s\n", spec.model().name(), spec.data().seq_len(),
                               std::max<int64_t>(1, spec.data().batch_size()), p.hardware());
  std::cout << (p.fits() ? std::string("fits") : p.message()) << "\n";
  if (p.has_memory()) {
    PrintStrategy(p);
  }
  if (p.max_seq_len() > 0) std::cout << "longest sequence that fits (one per step): " << p.max_seq_len() << " tokens\n";
}

void PrintStrategy(const v1::PlanResponse& p) {
  const v1::MemorySpec& m = p.memory();
  std::string strategy = absl::StrCat("recompute=", m.recompute());
  if (m.recompute() == "every_k") absl::StrAppend(&strategy, " (every ", m.recompute_every_k(), " layers)");
  absl::StrAppend(&strategy, " offload=", m.offload());
  if (m.offload() == "on") absl::StrAppend(&strategy, " (", p.device_resident(), " inputs kept on the GPU)");
  absl::StrAppend(&strategy, " mlp_tile=", m.mlp_tile_tokens(), " loss_tile=", m.loss_tile_tokens(),
                  " head_groups=", p.attention_head_groups());
  if (p.optimizer_on_host()) absl::StrAppend(&strategy, " optimizer_on_host");
  if (m.bf16_moments()) absl::StrAppend(&strategy, " bf16_moments");
  if (m.keep_selection()) absl::StrAppend(&strategy, " keep_selection");
  std::cout << "strategy: " << strategy << "\n";
  std::cout << "GPU peak " << GiB(p.gpu_peak_bytes()) << " of " << GiB(p.planned_gpu_bytes()) << "; pinned host "
            << GiB(p.host_bytes()) << " of " << GiB(p.planned_host_bytes()) << "\n";
  for (const v1::PlanTerm& t : p.terms()) std::cout << absl::StrFormat("  %-10s %s\n", GiB(t.bytes()), t.name());
}

bool Terminal(v1::Job::State s) {
  return s == v1::Job::SUCCEEDED || s == v1::Job::FAILED || s == v1::Job::CANCELLED;
}

// Follows a job to its end with a live progress line. Reconnects (for up to `reconnect_s`)
// when the controller goes away, e.g. while it restarts.
int Watch(Client& client, const std::string& name, double reconnect_s) {
  const bool tty = isatty(STDOUT_FILENO);
  int64_t total_steps = 0;
  bool rl_session = false;  // no step target: no bar, no ETA
  {
    grpc::ClientContext ctx;
    client.Prepare(&ctx);
    v1::GetJobRequest req;
    req.set_name(name);
    v1::Job job;
    grpc::Status s = client.stub()->GetJob(&ctx, req, &job);
    if (!s.ok()) return Fail(client.address(), s);
    total_steps = job.spec().steps();
    rl_session = job.spec().kind() == v1::RL_SESSION;
  }
  v1::Job::State state = v1::Job::STATE_UNSPECIFIED;
  double step_seconds_ema = 0;
  absl::Time last_print = absl::InfinitePast();
  absl::Time down_since = absl::InfiniteFuture();
  std::string line;
  auto print_line = [&](bool force) {
    const absl::Time now = absl::Now();
    if (!force && !tty && now - last_print < absl::Seconds(1)) return;
    last_print = now;
    if (tty) {
      std::cout << "\r\033[K" << line << std::flush;
    } else {
      std::cout << line << "\n" << std::flush;
    }
  };
  while (true) {
    grpc::ClientContext ctx;
    client.Authorize(&ctx);
    v1::WatchJobRequest req;
    req.set_name(name);
    auto reader = client.stub()->WatchJob(&ctx, req);
    v1::JobEvent event;
    while (reader->Read(&event)) {
      down_since = absl::InfiniteFuture();
      if (event.has_step()) {
        const v1::StepMetrics& m = event.step();
        if (m.step_seconds() > 0) {
          step_seconds_ema = step_seconds_ema == 0 ? m.step_seconds() : 0.8 * step_seconds_ema + 0.2 * m.step_seconds();
        }
        const double eta = step_seconds_ema > 0 ? (total_steps - m.step()) * step_seconds_ema : -1;
        const int width = 20;
        const int filled = total_steps > 0 ? static_cast<int>(width * m.step() / total_steps) : 0;
        std::string bar(std::clamp(filled, 0, width), '#');
        bar.resize(width, '.');
        line = rl_session ? absl::StrFormat("%s RL session  step %d  loss %.4f  %s tok/s", name, m.step(), m.loss(),
                                            FormatRate(m.tokens_per_second()))
                          : absl::StrFormat("%s [%s] step %d/%d  loss %.4f  %s tok/s  ETA %s", name, bar, m.step(),
                                            total_steps, m.loss(), FormatRate(m.tokens_per_second()),
                                            FormatDuration(eta));
        print_line(m.step() == total_steps);
        if (!m.trace().empty()) {
          if (tty && !line.empty()) std::cout << "\n";
          line.clear();
          std::cout << name << ": step " << m.step() << "'s trace: " << m.trace()
                    << " (bench/profile_report.py summarizes it and plots its memory)\n"
                    << std::flush;
        }
        if (m.step() == total_steps && m.phases_size() > 0) {
          // spec.profile.phase_times: where the last step's time went (the ten longest kinds).
          if (tty && !line.empty()) std::cout << "\n";
          line.clear();
          std::cout << name << ": step " << m.step() << "'s phases (a phase includes the phases inside it):\n";
          for (int i = 0; i < std::min(m.phases_size(), 10); ++i) {
            const v1::PhaseSeconds& ph = m.phases(i);
            std::cout << absl::StrFormat("  %-48s %10.3f s  %5.1f%%  x%d\n", ph.phase(), ph.seconds(),
                                         m.step_seconds() > 0 ? 100.0 * ph.seconds() / m.step_seconds() : 0.0,
                                         ph.count());
          }
          std::cout << std::flush;
        }
      } else if (event.has_state()) {
        state = event.state();
        if (tty && !line.empty()) std::cout << "\n";
        line.clear();
        std::cout << name << ": " << v1::Job::State_Name(state) << "\n" << std::flush;
      } else if (!event.checkpoint().empty()) {
        if (tty && !line.empty()) std::cout << "\n";
        std::cout << name << ": checkpoint " << event.checkpoint() << "\n" << std::flush;
      } else if (!event.message().empty()) {
        if (tty && !line.empty()) std::cout << "\n";
        std::cout << name << ": " << event.message() << "\n" << std::flush;
      }
    }
    grpc::Status s = reader->Finish();
    if (Terminal(state)) break;
    if (s.ok() || s.error_code() == grpc::StatusCode::UNAVAILABLE) {
      // The stream ended before the job did: the controller went away. Retry for a while.
      if (down_since == absl::InfiniteFuture()) {
        down_since = absl::Now();
        std::cerr << "odyssey: lost the controller, reconnecting...\n";
      }
      if (absl::Now() - down_since > absl::Seconds(reconnect_s)) {
        return Fail(client.address(), s.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "watch stream ended") : s);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(500));  // reconnect backoff
      continue;
    }
    return Fail(client.address(), s);
  }
  if (state == v1::Job::SUCCEEDED) return kExitOk;
  grpc::ClientContext ctx;
  client.Prepare(&ctx);
  v1::GetJobRequest req;
  req.set_name(name);
  v1::Job job;
  if (client.stub()->GetJob(&ctx, req, &job).ok() && !job.error().empty()) {
    std::cerr << "odyssey: " << name << " " << Lower(v1::Job::State_Name(state)) << ": " << job.error() << "\n";
  }
  return kExitJobFailed;
}

// One JobEvent as one line of JSON with the proto's field names: what odyssey-plot --events reads.
std::string EventLine(const v1::JobEvent& event) {
  std::string out;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(event, &out, options);
  return out;
}

// Every event recorded for job `name`, oldest first, following ListJobEvents' pages.
grpc::Status ListEvents(Client& client, const std::string& name, std::vector<v1::JobEvent>* events) {
  v1::ListJobEventsRequest req;
  req.set_name(name);
  while (true) {
    grpc::ClientContext ctx;
    client.Prepare(&ctx);
    v1::ListJobEventsResponse resp;
    grpc::Status s = client.stub()->ListJobEvents(&ctx, req, &resp);
    if (!s.ok()) return s;
    for (v1::JobEvent& e : *resp.mutable_events()) events->push_back(std::move(e));
    if (resp.next_page_token().empty()) return grpc::Status::OK;
    req.set_page_token(resp.next_page_token());
  }
}

// Writes all of `data` to `fd`; false when the reader went away.
bool WriteAll(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

// `odyssey plot`: the job's events through `python -m odyssey_client.plot --events -` (stdin).
int Plot(Client& client, const std::string& name, std::string output, bool json) {
  std::vector<v1::JobEvent> events;
  if (grpc::Status s = ListEvents(client, name, &events); !s.ok()) return Fail(client.address(), s);
  std::string lines;
  for (const v1::JobEvent& e : events) absl::StrAppend(&lines, EventLine(e), "\n");
  if (json) {
    std::cout << lines << std::flush;
    return kExitOk;
  }
  if (output.empty()) output = absl::StrCat(absl::StrReplaceAll(name, {{"/", "-"}}), ".png");
  const char* env_python = std::getenv("ODYSSEY_PYTHON");
  const std::string python = env_python && *env_python ? env_python : "python3";
  const std::string hint =
      "odyssey plot draws with the Python client and matplotlib: pip install './client/python[plot]' "
      "(ODYSSEY_PYTHON picks the interpreter)";
  std::vector<std::string> args = {python, "-m", "odyssey_client.plot", name, "--events", "-", "-o", output};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  int fds[2];
  if (::pipe(fds) != 0) {
    std::cerr << "odyssey: plot: pipe failed (" << std::strerror(errno) << ")\n";
    return kExitJobFailed;
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[0], STDIN_FILENO);
  posix_spawn_file_actions_addclose(&actions, fds[0]);
  posix_spawn_file_actions_addclose(&actions, fds[1]);
  pid_t pid = 0;
  const int err = posix_spawnp(&pid, python.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(fds[0]);
  if (err != 0) {
    ::close(fds[1]);
    std::cerr << "odyssey: plot: cannot run " << python << " (" << std::strerror(err) << "); " << hint << "\n";
    return kExitJobFailed;
  }
  // A child that exits early (no matplotlib) closes the pipe: its error, not SIGPIPE, is the story.
  std::signal(SIGPIPE, SIG_IGN);
  WriteAll(fds[1], lines);
  ::close(fds[1]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return kExitOk;
  // 2: odyssey_client.plot refused the input and said why (no steps yet, no matplotlib).
  if (WIFEXITED(status) && WEXITSTATUS(status) == kExitUsage) return kExitUsage;
  std::cerr << "odyssey: plot: `" << python << " -m odyssey_client.plot` "
            << (WIFEXITED(status) ? absl::StrCat("exited with status ", WEXITSTATUS(status)) : std::string("was killed"))
            << "; " << hint << "\n";
  return kExitJobFailed;
}

// Values the completion offers after options that take one: files, job states, or nothing (a
// free value such as an address or a number).
enum class ValueKind { kFree, kFile, kState };

ValueKind KindOf(const std::string& name) {
  if (name == "--tls-ca" || name == "--tls-cert" || name == "--tls-key" || name == "--token-file" ||
      name == "--output" || name == "-o") {
    return ValueKind::kFile;
  }
  if (name == "--state") return ValueKind::kState;
  return ValueKind::kFree;
}

// The long and short names of `app`'s options and flags; those that take a value also go to
// *valued.
std::vector<std::string> OptionNames(const CLI::App& app, std::vector<std::string>* valued) {
  std::vector<std::string> names;
  for (const CLI::Option* opt : app.get_options()) {
    if (opt->get_positional()) continue;
    std::vector<std::string> these;
    for (const std::string& l : opt->get_lnames()) these.push_back("--" + l);
    for (const std::string& s : opt->get_snames()) these.push_back("-" + s);
    for (const std::string& n : these) {
      names.push_back(n);
      if (opt->get_type_size_max() > 0) valued->push_back(n);
    }
  }
  return names;
}

// The completion function; @NAME@ are filled in by BashCompletion. Spec files are matched with
// compgen -G, which needs no extglob.
constexpr char kBashCompletion[] = R"(# bash completion for odyssey (@VERSION@): source <(odyssey completion bash)
_odyssey() {
  local cur="${COMP_WORDS[COMP_CWORD]}" prev="${COMP_WORDS[COMP_CWORD-1]}"
  local global="@GLOBAL@"
  local subcommands="@SUBCOMMANDS@"
  local sub="" i flags="" words="" spec=""
  for ((i = 1; i < COMP_CWORD; i++)); do
    case " $subcommands " in *" ${COMP_WORDS[i]} "*) sub="${COMP_WORDS[i]}"; break ;; esac
  done
  case "$prev" in
    @FILE_OPTIONS@) COMPREPLY=($(compgen -f -- "$cur")); return ;;
    @STATE_OPTIONS@) COMPREPLY=($(compgen -W "PENDING RUNNING SUCCEEDED FAILED CANCELLED" -- "$cur")); return ;;
    @FREE_OPTIONS@) COMPREPLY=(); return ;;
  esac
  case "$sub" in
    "") COMPREPLY=($(compgen -W "$subcommands $global" -- "$cur")); return ;;
@PER_SUBCOMMAND@  esac
  if [[ "$cur" == -* ]]; then
    COMPREPLY=($(compgen -W "$flags $global" -- "$cur"))
  elif [[ -n "$words" ]]; then
    COMPREPLY=($(compgen -W "$words" -- "$cur"))
  elif [[ -n "$spec" ]]; then
    COMPREPLY=($(compgen -G "$cur*.yaml"; compgen -G "$cur*.yml"; compgen -G "$cur*.json"; compgen -d -- "$cur"))
  fi
}
complete -o filenames -F _odyssey odyssey
)";

// A bash completion script for `odyssey` generated from the CLI's own definitions, so a new
// subcommand or flag completes without editing a script: subcommands, each one's flags plus the
// global ones (they work in any position), spec files (*.yaml, *.yml, *.json) for the commands
// that take one, files after the TLS and token flags, job states after --state, shells after
// `completion`.
std::string BashCompletion(const CLI::App& app) {
  std::vector<std::string> valued;
  const std::vector<std::string> global = OptionNames(app, &valued);
  std::vector<std::string> subcommands;
  std::string per_sub;
  for (const CLI::App* sub : app.get_subcommands({})) {
    subcommands.push_back(sub->get_name());
    absl::StrAppend(&per_sub, "    ", sub->get_name(), ")\n      flags=\"", absl::StrJoin(OptionNames(*sub, &valued), " "),
                    "\"\n");
    for (const CLI::Option* opt : sub->get_options()) {
      if (!opt->get_positional()) continue;
      if (opt->get_name() == "spec") absl::StrAppend(&per_sub, "      spec=1\n");
      if (opt->get_name() == "shell") absl::StrAppend(&per_sub, "      words=\"bash zsh\"\n");
    }
    absl::StrAppend(&per_sub, "      ;;\n");
  }
  std::sort(valued.begin(), valued.end());
  valued.erase(std::unique(valued.begin(), valued.end()), valued.end());
  std::vector<std::string> by_kind[3];
  for (const std::string& n : valued) by_kind[static_cast<int>(KindOf(n))].push_back(n);
  // A case pattern that never matches stands in for an empty list.
  auto pattern = [](const std::vector<std::string>& names) {
    return names.empty() ? std::string("--odyssey-none") : absl::StrJoin(names, "|");
  };
  return absl::StrReplaceAll(kBashCompletion, {{"@VERSION@", odyssey::VersionLine("odyssey")},
                                               {"@GLOBAL@", absl::StrJoin(global, " ")},
                                               {"@SUBCOMMANDS@", absl::StrJoin(subcommands, " ")},
                                               {"@FILE_OPTIONS@", pattern(by_kind[static_cast<int>(ValueKind::kFile)])},
                                               {"@STATE_OPTIONS@", pattern(by_kind[static_cast<int>(ValueKind::kState)])},
                                               {"@FREE_OPTIONS@", pattern(by_kind[static_cast<int>(ValueKind::kFree)])},
                                               {"@PER_SUBCOMMAND@", per_sub}});
}

std::string RandomRequestId() {
  std::random_device rd;
  return absl::StrFormat("cli-%016x%016x", (static_cast<uint64_t>(rd()) << 32) | rd(),
                         (static_cast<uint64_t>(rd()) << 32) | rd());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"odyssey: submit and follow training jobs on an odyssey-controller"};
  app.require_subcommand(1);
  app.set_version_flag("--version", odyssey::VersionLine("odyssey"));
  // Subcommands (added below, so they inherit it) hand the flags they do not know to this app:
  // the global flags work before or after the subcommand.
  app.fallthrough();
  const char* env = std::getenv("ODYSSEY_CONTROLLER");
  std::string controller = env && *env ? env : "localhost:50051";
  double timeout_s = 10;
  bool json = false;
  app.add_option("--controller", controller, "Controller address host:port (env ODYSSEY_CONTROLLER)")
      ->capture_default_str();
  app.add_option("--timeout", timeout_s, "Seconds to wait for each call")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_flag("--json", json, "Print jobs as JSON (plot: the job's events, one JSON object a line)");
  odyssey::ClientTlsOptions tls;
  const char* tls_ca_env = std::getenv("ODYSSEY_TLS_CA");
  if (tls_ca_env) tls.ca = tls_ca_env;
  std::string token_file;
  app.add_option("--tls-ca", tls.ca, "PEM CA bundle that signed the controller's certificate: TLS on (env ODYSSEY_TLS_CA)");
  app.add_option("--tls-server-name", tls.server_name, "Name to verify in the controller's certificate instead of the host");
  app.add_option("--tls-cert", tls.cert, "PEM client certificate, for a controller with --tls-client-ca (mTLS)");
  app.add_option("--tls-key", tls.key, "PEM private key of --tls-cert");
  app.add_option("--token-file", token_file, "File holding your bearer token (else env ODYSSEY_TOKEN holds the token)");

  std::string spec_path, request_id;
  bool submit_watch = false;
  double reconnect_s = 60;
  auto* submit = app.add_subcommand("submit", "Create a job from a YAML or JSON JobSpec file; prints its name");
  submit->add_option("spec", spec_path, "Spec file (.yaml or .json)")->required();
  submit->add_option("--request-id", request_id, "Idempotency key: a retry with the same id returns the same job (default: random)");
  submit->add_flag("--watch,-w", submit_watch, "Follow the job until it ends (exit 1 if it fails)");
  submit->add_option("--reconnect", reconnect_s, "With --watch: seconds to keep reconnecting to a lost controller")->capture_default_str();

  std::string state_filter;
  int page_size = 0;
  bool all = false;
  auto* list = app.add_subcommand("list", "List jobs, newest first");
  list->add_option("--state", state_filter, "Only jobs in this state (PENDING, RUNNING, SUCCEEDED, FAILED, CANCELLED)");
  list->add_option("--page-size", page_size, "Jobs per page (0 = server default)");
  list->add_flag("--all", all, "Follow every page");

  std::string job_arg;
  auto* get = app.add_subcommand("get", "Show a job");
  get->add_option("job", job_arg, "jobs/N or N")->required();
  auto* watch = app.add_subcommand("watch", "Follow a job until it ends (exit 0 SUCCEEDED, 1 FAILED/CANCELLED)");
  watch->add_option("job", job_arg, "jobs/N or N")->required();
  watch->add_option("--reconnect", reconnect_s, "Seconds to keep reconnecting to a lost controller")->capture_default_str();
  auto* cancel = app.add_subcommand("cancel", "Cancel a PENDING or RUNNING job");
  cancel->add_option("job", job_arg, "jobs/N or N")->required();
  int64_t plan_gpu_bytes = 0, plan_host_bytes = 0;
  bool plan_max = false;
  auto* plan = app.add_subcommand("plan", "What a spec needs per GPU rank, from the controller's planner (exit 0 fits, 1 not)");
  plan->add_option("spec", spec_path, "Spec file (.yaml or .json)")->required();
  plan->add_option("--gpu-bytes", plan_gpu_bytes, "GPU memory to plan for (default: the attached workers' largest GPU)");
  plan->add_option("--host-bytes", plan_host_bytes, "Pinned host memory per rank (default: that worker's)");
  plan->add_flag("--max-seq-len", plan_max, "Also find the longest sequence that fits");

  std::string plot_output;
  auto* plot_cmd = app.add_subcommand("plot", "Draw a job's loss, tokens/s and GPU memory over its steps into a PNG");
  plot_cmd->add_option("job", job_arg, "jobs/N or N")->required();
  plot_cmd->add_option("-o,--output", plot_output, "PNG to write (default: jobs-N.png here)");

  std::string shell;
  auto* completion = app.add_subcommand("completion", "Print a shell completion script: source <(odyssey completion bash)");
  completion->add_option("shell", shell, "bash or zsh (zsh loads the bash script through bashcompinit)")
      ->required()
      ->check(CLI::IsMember({"bash", "zsh"}));

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? kExitOk : kExitUsage;
  }

  if (completion->parsed()) {
    if (shell == "zsh") std::cout << "autoload -U +X bashcompinit && bashcompinit\n";
    std::cout << BashCompletion(app);
    return kExitOk;
  }

  grpc::ChannelArguments channel_args;
  auto credentials = odyssey::MakeChannelCredentials(tls, &channel_args);
  if (!credentials.ok()) {
    std::cerr << "odyssey: " << credentials.status().message() << "\n";
    return kExitUsage;
  }
  std::string token;
  if (!token_file.empty()) {
    auto read = odyssey::ReadTokenFile(token_file, "--token-file");
    if (!read.ok()) {
      std::cerr << "odyssey: " << read.status().message() << "\n";
      return kExitUsage;
    }
    token = *std::move(read);
  } else if (const char* env_token = std::getenv("ODYSSEY_TOKEN"); env_token && *env_token) {
    token = std::string(absl::StripAsciiWhitespace(env_token));
  }
  Client client(controller, timeout_s, *credentials, channel_args, token);
  // submit and plan: the spec file, or a usage error naming the file and the field.
  absl::StatusOr<v1::JobSpec> spec;
  if (submit->parsed() || plan->parsed()) {
    spec = odyssey::client::LoadJobSpec(spec_path);
    if (!spec.ok()) {
      std::cerr << "odyssey: " << spec.status().message() << "\n";
      return kExitUsage;
    }
  }
  if (submit->parsed()) {
    v1::CreateJobRequest req;
    *req.mutable_spec() = *spec;
    req.set_request_id(request_id.empty() ? RandomRequestId() : request_id);
    v1::Job job;
    grpc::Status s;
    // Retrying with the same request id is safe: the controller creates the job once.
    for (int attempt = 0; attempt < 3; ++attempt) {
      grpc::ClientContext ctx;
      client.Prepare(&ctx);
      s = client.stub()->CreateJob(&ctx, req, &job);
      if (s.error_code() != grpc::StatusCode::UNAVAILABLE) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(300 << attempt));  // retry backoff
    }
    if (!s.ok()) return Fail(controller, s);
    if (json) {
      std::cout << ToJson(job) << "\n";
    } else {
      std::cout << job.name() << "\n";
    }
    std::cout << std::flush;
    return submit_watch ? Watch(client, job.name(), reconnect_s) : kExitOk;
  }
  if (plan->parsed()) {
    v1::PlanRequest req;
    *req.mutable_spec() = *spec;
    req.set_gpu_bytes(plan_gpu_bytes);
    req.set_host_bytes(plan_host_bytes);
    req.set_max_seq_len(plan_max);
    grpc::ClientContext ctx;
    client.Prepare(&ctx);
    v1::PlanResponse resp;
    grpc::Status s = client.planner()->Plan(&ctx, req, &resp);
    if (!s.ok()) return Fail(controller, s);
    if (json) {
      std::cout << ToJson(resp) << "\n";
    } else {
      PrintPlan(*spec, resp);
    }
    return resp.fits() ? kExitOk : kExitJobFailed;
  }
  if (list->parsed()) {
    v1::ListJobsRequest req;
    req.set_page_size(page_size);
    if (!state_filter.empty()) {
      v1::Job::State state;
      std::string upper = state_filter;
      for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
      if (!v1::Job::State_Parse(upper, &state)) {
        std::cerr << "odyssey: --state \"" << state_filter
                  << "\" must be one of PENDING, RUNNING, SUCCEEDED, FAILED, CANCELLED\n";
        return kExitUsage;
      }
      req.set_state(state);
    }
    bool header = !json;  // printed once the first page came back (not above an error)
    while (true) {
      grpc::ClientContext ctx;
      client.Prepare(&ctx);
      v1::ListJobsResponse resp;
      grpc::Status s = client.stub()->ListJobs(&ctx, req, &resp);
      if (!s.ok()) return Fail(controller, s);
      if (header) {
        std::cout << absl::StrFormat("%-10s %-10s %-13s %-9s %-9s %-19s %s\n", "NAME", "STATE", "STEP", "LOSS",
                                     "WORKERS", "CREATED", "DISPLAY NAME");
        header = false;
      }
      for (const v1::Job& job : resp.jobs()) {
        if (json) {
          std::cout << ToJson(job) << "\n";
          continue;
        }
        std::cout << absl::StrFormat("%-10s %-10s %-13s %-9.4f %-9d %-19s %s\n", job.name(),
                                     v1::Job::State_Name(job.state()),
                                     job.spec().kind() == v1::RL_SESSION
                                         ? absl::StrCat(job.step(), " (rl)")
                                         : absl::StrCat(job.step(), "/", job.spec().steps()),
                                     job.loss(),
                                     std::max(1, job.spec().parallel().world_size()), FormatTime(job.create_time()),
                                     job.spec().display_name());
        if (!job.pending_reason().empty()) std::cout << "           waiting: " << job.pending_reason() << "\n";
      }
      if (!all || resp.next_page_token().empty()) break;
      req.set_page_token(resp.next_page_token());
    }
    return kExitOk;
  }
  const std::string name = JobName(job_arg);
  if (get->parsed()) {
    grpc::ClientContext ctx;
    client.Prepare(&ctx);
    v1::GetJobRequest req;
    req.set_name(name);
    v1::Job job;
    grpc::Status s = client.stub()->GetJob(&ctx, req, &job);
    if (!s.ok()) return Fail(controller, s);
    if (json) {
      std::cout << ToJson(job) << "\n";
    } else {
      PrintJob(job);
    }
    return kExitOk;
  }
  if (watch->parsed()) return Watch(client, name, reconnect_s);
  if (plot_cmd->parsed()) return Plot(client, name, plot_output, json);
  if (cancel->parsed()) {
    grpc::ClientContext ctx;
    client.Prepare(&ctx);
    v1::CancelJobRequest req;
    req.set_name(name);
    v1::Job job;
    grpc::Status s = client.stub()->CancelJob(&ctx, req, &job);
    if (!s.ok()) return Fail(controller, s);
    std::cout << job.name() << ": " << v1::Job::State_Name(job.state()) << "\n";
    return kExitOk;
  }
  return kExitUsage;
}
