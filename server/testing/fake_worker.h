// Test support: a fake odyssey-worker speaking the Attach protocol (server/README.md) with no
// engine behind it. The test drives it: it attaches (hello, then held), heartbeats on its own
// thread, records every ControllerMessage, and sends the progress/results the test asks for.
//
// Thread safety: all methods may be called from any thread.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "odyssey/v1/odyssey.grpc.pb.h"

namespace odyssey::server::testing {

class FakeWorker {
 public:
  // Attaches to `address` as `worker_id`, reporting `held` jobs. Heartbeats every `heartbeat`.
  FakeWorker(const std::string& address, const std::string& worker_id, std::vector<std::string> held = {},
             absl::Duration heartbeat = absl::Milliseconds(200));
  ~FakeWorker();
  FakeWorker(const FakeWorker&) = delete;
  FakeWorker& operator=(const FakeWorker&) = delete;

  const std::string& id() const { return id_; }

  bool Send(const odyssey::v1::WorkerMessage& message);
  bool Progress(const std::string& job, int rank, int64_t step, int64_t tokens = 0, double loss = 1.0,
                const std::string& checkpoint = "", double step_seconds = 0.1);
  bool Result(const std::string& job, int rank, bool ok, int64_t step = 0, const std::string& cancelled = "");

  // Waits up to `timeout` for a received message matching `match`; consumes nothing.
  std::optional<odyssey::v1::ControllerMessage> WaitFor(
      const std::function<bool(const odyssey::v1::ControllerMessage&)>& match, absl::Duration timeout);
  std::optional<odyssey::v1::Assignment> WaitForAssignment(const std::string& job, absl::Duration timeout);
  std::vector<odyssey::v1::ControllerMessage> Received();
  std::vector<odyssey::v1::Assignment> Assignments();
  // True once the stream ended (the controller closed it or went away).
  bool Ended();

  // Ends the stream (like a worker process exiting).
  void Close();

 private:
  void ReadLoop();
  void HeartbeatLoop();

  const std::string id_;
  const absl::Duration heartbeat_;
  std::unique_ptr<odyssey::v1::WorkerService::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<odyssey::v1::WorkerMessage, odyssey::v1::ControllerMessage>> stream_;
  absl::Mutex write_mu_;  // one writer at a time on the stream
  absl::Mutex mu_;
  std::vector<odyssey::v1::ControllerMessage> received_ ABSL_GUARDED_BY(mu_);
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  std::thread reader_;
  std::thread heartbeater_;
};

}  // namespace odyssey::server::testing
