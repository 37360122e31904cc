#include "server/testing/controller_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"

namespace odyssey::server::testing {
namespace {

bool ReadPort(const std::string& path, int* port) {
  std::ifstream in(path);
  std::string text;
  if (!std::getline(in, text)) return false;
  return absl::SimpleAtoi(absl::StripAsciiWhitespace(text), port) && *port > 0;
}

std::string Tail(const std::string& path, size_t bytes) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string all = ss.str();
  return all.size() > bytes ? all.substr(all.size() - bytes) : all;
}

}  // namespace

std::string ControllerBinaryFromEnv() {
  const char* p = std::getenv("ODYSSEY_CONTROLLER_BINARY");
  return p ? p : "";
}

std::string ControllerProcess::log_path() const { return options_.work_dir + "/controller.log"; }

absl::StatusOr<std::unique_ptr<ControllerProcess>> ControllerProcess::Start(const Options& options) {
  if (options.binary.empty() || !std::filesystem::exists(options.binary)) {
    return absl::FailedPreconditionError(
        absl::StrCat("odyssey-controller binary \"", options.binary, "\" not found (set ODYSSEY_CONTROLLER_BINARY)"));
  }
  std::filesystem::create_directories(options.work_dir);
  std::unique_ptr<ControllerProcess> p(new ControllerProcess());
  p->options_ = options;
  const std::string port_file = options.work_dir + "/controller.port";
  const std::string metrics_port_file = options.work_dir + "/controller.metrics_port";
  std::filesystem::remove(port_file);
  std::filesystem::remove(metrics_port_file);

  std::vector<std::string> args = {options.binary,
                                   "--listen=127.0.0.1:0",
                                   "--port-file=" + port_file,
                                   "--metrics-listen=127.0.0.1:0",
                                   "--metrics-port-file=" + metrics_port_file,
                                   "--state-dir=" + options.state_dir};
  args.insert(args.end(), options.extra_args.begin(), options.extra_args.end());
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const std::string log = p->log_path();

  p->pid_ = fork();
  if (p->pid_ < 0) return absl::InternalError("fork failed");
  if (p->pid_ == 0) {
    int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
      dup2(fd, STDOUT_FILENO);
      dup2(fd, STDERR_FILENO);
      close(fd);
    }
    execv(argv[0], argv.data());
    _exit(127);
  }

  const absl::Time deadline = absl::Now() + options.start_timeout;
  while (true) {
    if (ReadPort(port_file, &p->port_) && ReadPort(metrics_port_file, &p->metrics_port_)) return p;
    int status = 0;
    if (waitpid(p->pid_, &status, WNOHANG) == p->pid_) {
      p->pid_ = -1;
      return absl::InternalError(absl::StrCat("odyssey-controller exited while starting (status ", status,
                                              "); log:\n", Tail(log, 2000)));
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat("odyssey-controller did not write its port file within ",
                                                      absl::FormatDuration(options.start_timeout), "; log:\n",
                                                      Tail(log, 2000)));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));  // poll interval, bounded by the deadline
  }
}

int ControllerProcess::Reap(absl::Duration timeout) {
  if (pid_ <= 0) return -1;
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    int status = 0;
    pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == pid_ || r < 0) {
      pid_ = -1;
      if (r < 0) return -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    if (absl::Now() > deadline) return -2;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

void ControllerProcess::Kill9() {
  if (pid_ <= 0) return;
  kill(pid_, SIGKILL);
  Reap(absl::Seconds(30));
}

int ControllerProcess::Terminate() {
  if (pid_ <= 0) return -1;
  kill(pid_, SIGTERM);
  int rc = Reap(absl::Seconds(10));
  if (rc == -2) {
    Kill9();
    return 128 + SIGKILL;
  }
  return rc;
}

ControllerProcess::~ControllerProcess() {
  if (pid_ > 0) Terminate();
}

}  // namespace odyssey::server::testing
