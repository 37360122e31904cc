// Test support: runs the real odyssey-controller binary as a child process on loopback ports
// chosen at run time (--listen 127.0.0.1:0 + --port-file), for cross-process tests.
//
// Start() returns once the controller has written its port files (it is serving), or fails
// with the tail of its log if it exits or does not come up before the deadline. Not
// thread-safe: one test thread drives one ControllerProcess.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace odyssey::server::testing {

class ControllerProcess {
 public:
  struct Options {
    std::string binary;      // path to odyssey-controller
    std::string state_dir;   // --state-dir
    std::string work_dir;    // port files and controller.log go here
    std::vector<std::string> extra_args;
    absl::Duration start_timeout = absl::Seconds(30);
  };
  static absl::StatusOr<std::unique_ptr<ControllerProcess>> Start(const Options& options);
  // Stops the process (SIGTERM, then SIGKILL after 10 s) unless it already ended.
  ~ControllerProcess();
  ControllerProcess(const ControllerProcess&) = delete;
  ControllerProcess& operator=(const ControllerProcess&) = delete;

  // kill -9 and reap.
  void Kill9();
  // SIGTERM and reap; returns the exit status (or 128 + signal).
  int Terminate();

  int port() const { return port_; }
  pid_t pid() const { return pid_; }
  int metrics_port() const { return metrics_port_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  std::string log_path() const;

 private:
  ControllerProcess() = default;
  int Reap(absl::Duration timeout);

  Options options_;
  pid_t pid_ = -1;
  int port_ = 0;
  int metrics_port_ = 0;
};

// Path of the odyssey-controller binary for tests: $ODYSSEY_CONTROLLER_BINARY.
std::string ControllerBinaryFromEnv();

}  // namespace odyssey::server::testing
