// odyssey-worker: attaches to an odyssey-controller and runs the jobs it assigns on one device.
// SIGINT/SIGTERM stop it cleanly: a running job is stopped between steps and its result sent,
// marked worker_leaving (the controller restarts the job elsewhere).
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/metrics_endpoint.h"
#include "common/tls.h"
#include "common/version.h"
#include "grpcpp/support/channel_arguments.h"
#include "worker/engine_job.h"
#include "common/files.h"
#include "worker/job_runner.h"
#include "worker/worker.h"
#include "worker/worker_metrics.h"

int main(int argc, char** argv) {
  std::string controller = "127.0.0.1:50051";
  std::string worker_id;
  std::string device = "auto";
  std::string metrics_listen;
  std::string metrics_port_file;
  int threads = 0;
  double heartbeat_interval_s = 1.0;
  double progress_interval_s = 0.25;
  double max_backoff_s = 5.0;
  double peer_loss_grace_s = 30.0;
  int max_message_bytes = 64 << 20;
  odyssey::ClientTlsOptions tls;
  std::string token_file;

  CLI::App app{"odyssey-worker: runs odyssey jobs on one device for an odyssey-controller"};
  app.set_version_flag("--version", odyssey::VersionLine("odyssey-worker"));
  app.add_option("--controller", controller, "controller gRPC address host:port")->capture_default_str();
  app.add_option("--worker-id", worker_id, "stable worker id (default: <hostname>-<pid>)");
  app.add_option("--device", device, "auto | cpu | cuda | cuda:N")->capture_default_str();
  app.add_option("--metrics-listen", metrics_listen, "Prometheus /metrics address host:port (port 0 = any; empty = off)");
  app.add_option("--metrics-port-file", metrics_port_file, "write the bound metrics port here once serving");
  app.add_option("--threads", threads, "CPU threads for torch (0: torch's default)")->capture_default_str();
  app.add_option("--heartbeat-interval", heartbeat_interval_s, "seconds between heartbeats")->capture_default_str();
  app.add_option("--progress-interval", progress_interval_s, "min seconds between progress messages")
      ->capture_default_str();
  app.add_option("--peer-loss-grace", peer_loss_grace_s,
                 "seconds a rank whose peer died waits for the controller's cancel before failing the job")
      ->capture_default_str();
  app.add_option("--max-backoff", max_backoff_s, "max seconds between reconnect attempts")->capture_default_str();
  app.add_option("--max-message-bytes", max_message_bytes, "gRPC message size limit")->capture_default_str();
  app.add_option("--tls-ca", tls.ca, "PEM CA bundle that signed the controller's certificate: TLS on (empty: plaintext)");
  app.add_option("--tls-server-name", tls.server_name,
                 "name to verify in the controller's certificate instead of --controller's host");
  app.add_option("--tls-cert", tls.cert, "PEM client certificate, for a controller with --tls-client-ca (mTLS)");
  app.add_option("--tls-key", tls.key, "PEM private key of --tls-cert");
  app.add_option("--token-file", token_file,
                 "file holding this worker's bearer token (a token of tenant @worker in the controller's "
                 "--auth-token-file); re-read on every reconnect");
  CLI11_PARSE(app, argc, argv);

  // Check the credential files now: a bad flag is a startup error, not a silent retry loop.
  {
    grpc::ChannelArguments args;
    auto credentials = odyssey::MakeChannelCredentials(tls, &args);
    if (!credentials.ok()) {
      std::fprintf(stderr, "odyssey-worker: %s\n", std::string(credentials.status().message()).c_str());
      return 2;
    }
    if (!token_file.empty()) {
      auto token = odyssey::ReadTokenFile(token_file, "--token-file");
      if (!token.ok()) {
        std::fprintf(stderr, "odyssey-worker: %s\n", std::string(token.status().message()).c_str());
        return 2;
      }
    }
  }

  // Signals go to one thread that asks the worker to stop (blocked here, before any thread starts).
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  odyssey::worker::SetTorchThreads(threads);
  odyssey::worker::WorkerOptions options;
  options.controller = controller;
  options.tls = tls;
  options.token_file = token_file;
  absl::StatusOr<odyssey::v1::WorkerCapabilities> caps = odyssey::worker::ProbeCapabilities(device);
  if (!caps.ok()) {
    std::fprintf(stderr, "odyssey-worker: --device: %s\n", std::string(caps.status().message()).c_str());
    return 2;
  }
  options.capabilities = *caps;
  options.capabilities.set_worker_id(worker_id.empty() ? absl::StrCat(caps->hostname(), "-", ::getpid()) : worker_id);
  options.runner.device = caps->device();
  options.runner.progress_interval_seconds = progress_interval_s;
  options.runner.peer_loss_grace_seconds = peer_loss_grace_s;
  options.heartbeat_interval = absl::Seconds(heartbeat_interval_s);
  options.max_backoff = absl::Seconds(max_backoff_s);
  options.max_message_bytes = max_message_bytes;

  odyssey::worker::WorkerMetrics metrics;
  if (absl::StartsWith(caps->device(), "cuda"))
    metrics.gpu_memory_capacity->Set(static_cast<double>(caps->device_memory_bytes()));
  std::unique_ptr<odyssey::MetricsEndpoint> endpoint;
  if (!metrics_listen.empty()) {
    auto e = odyssey::MetricsEndpoint::Create(metrics_listen, metrics.registry());
    if (!e.ok()) {
      std::fprintf(stderr, "odyssey-worker: --metrics-listen: %s\n", std::string(e.status().message()).c_str());
      return 2;
    }
    endpoint = *std::move(e);
    odyssey::LogInfo(absl::StrCat("worker=", options.capabilities.worker_id(), " metrics at http://",
                                  metrics_listen.substr(0, metrics_listen.rfind(':')), ":", endpoint->port(),
                                  "/metrics"));
    if (!metrics_port_file.empty()) {
      if (absl::Status s = odyssey::WriteFileAtomically(metrics_port_file, absl::StrCat(endpoint->port(), "\n"));
          !s.ok()) {
        std::fprintf(stderr, "odyssey-worker: --metrics-port-file: %s\n", std::string(s.message()).c_str());
        return 2;
      }
    }
  }
  odyssey::LogInfo(absl::StrCat("worker=", options.capabilities.worker_id(), " device ", options.capabilities.device(),
                                " (", options.capabilities.device_name(), "), controller ", controller));

  odyssey::worker::Worker worker(options, &metrics);
  std::thread signal_thread([&worker, signals] {
    int sig = 0;
    sigwait(&signals, &sig);
    odyssey::LogInfo(absl::StrCat("signal ", sig, ": stopping"));
    worker.Shutdown();
  });
  signal_thread.detach();  // blocked in sigwait until a signal; the process may end before one comes
  absl::Status s = worker.Run();
  if (!s.ok()) {
    odyssey::LogError(std::string(s.message()));
    return 1;
  }
  odyssey::LogInfo(absl::StrCat("worker=", options.capabilities.worker_id(), " stopped"));
  return 0;
}
