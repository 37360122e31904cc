// odyssey-controller: the job service. Flags are documented in server/README.md.
#include <signal.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "common/metrics_endpoint.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "server/controller.h"
#include "server/service.h"
#include "spdlog/spdlog.h"

namespace {

// Writes `text` to `path` atomically (write then rename), so a reader never sees a partial file.
bool WriteFileAtomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text << "\n";
    if (!out.good()) return false;
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  return !ec;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"odyssey-controller: schedules training jobs onto attached odyssey-worker daemons"};
  std::string listen = "0.0.0.0:50051";
  std::string port_file;
  std::string state_dir = "./odyssey-state";
  std::string metrics_listen = "0.0.0.0:9464";
  std::string metrics_port_file;
  double heartbeat_timeout_s = 10;
  // A TrainingService batch of 1M tokens with every per-token array is ~20 MB; 64 MiB leaves
  // room for ~3M-token batches (and matches the worker's default).
  int64_t max_message_bytes = 64 << 20;
  int rendezvous_port_base = 29500;
  double sequence_wait_s = 30;
  app.add_option("--listen", listen, "gRPC address host:port (port 0 = any free port, see --port-file)")
      ->capture_default_str();
  app.add_option("--port-file", port_file, "Write the bound gRPC port here (atomically) once serving");
  app.add_option("--state-dir", state_dir, "Folder of the SQLite job store (controller.db) and default checkpoints")
      ->capture_default_str();
  app.add_option("--metrics-listen", metrics_listen, "Prometheus /metrics address host:port (port 0 = any; empty = off)")
      ->capture_default_str();
  app.add_option("--metrics-port-file", metrics_port_file, "Write the bound metrics port here once serving");
  app.add_option("--heartbeat-timeout", heartbeat_timeout_s,
                 "Seconds without a message before a worker is disconnected, and again before it is dead")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--max-message-bytes", max_message_bytes,
                 "Largest gRPC message accepted or sent (also TrainingService batches and their forwarding to "
                 "workers; keep the workers' --max-message-bytes at least as large); larger ones get "
                 "RESOURCE_EXHAUSTED")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1024}, int64_t{1} << 30));
  app.add_option("--sequence-wait", sequence_wait_s,
                 "Seconds a sequenced TrainingService call waits for its predecessor before it gets ABORTED")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--rendezvous-port-base", rendezvous_port_base,
                 "Rank 0 of job N hosts its rendezvous on port base + N % 10000")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  // A peer that goes away mid-write (a /metrics scraper, a client) must not kill the process.
  signal(SIGPIPE, SIG_IGN);
  // Signals are taken by a sigwait thread; block them before any thread starts.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  std::error_code ec;
  std::filesystem::create_directories(state_dir, ec);
  if (ec) {
    std::cerr << "odyssey-controller: cannot create --state-dir " << state_dir << ": " << ec.message() << "\n";
    return 1;
  }
  const std::string db_path = (std::filesystem::path(state_dir) / "controller.db").string();
  auto store = odyssey::server::JobStore::Open(db_path);
  if (!store.ok()) {
    std::cerr << "odyssey-controller: " << store.status().message() << "\n";
    return 1;
  }
  auto registry = std::make_shared<prometheus::Registry>();
  odyssey::server::ControllerOptions options;
  options.heartbeat_timeout = absl::Seconds(heartbeat_timeout_s);
  options.checkpoint_root = std::filesystem::absolute(std::filesystem::path(state_dir) / "checkpoints").string();
  options.rendezvous_port_base = rendezvous_port_base;
  options.sequence_wait = absl::Seconds(sequence_wait_s);
  options.registry = registry;
  auto controller = odyssey::server::Controller::Create(options, std::move(*store));
  if (!controller.ok()) {
    std::cerr << "odyssey-controller: " << controller.status().message() << "\n";
    return 1;
  }

  odyssey::server::JobServiceImpl job_service(controller->get(), registry.get());
  odyssey::server::TrainingServiceImpl training_service(controller->get());
  odyssey::server::WorkerServiceImpl worker_service(controller->get());
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(static_cast<int>(max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(max_message_bytes));
  builder.RegisterService(&job_service);
  builder.RegisterService(&training_service);
  builder.RegisterService(&worker_service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    std::cerr << "odyssey-controller: cannot listen on --listen " << listen << "\n";
    return 1;
  }

  std::unique_ptr<odyssey::MetricsEndpoint> metrics;
  if (!metrics_listen.empty()) {
    auto endpoint = odyssey::MetricsEndpoint::Create(metrics_listen, registry);
    if (!endpoint.ok()) {
      std::cerr << "odyssey-controller: --metrics-listen: " << endpoint.status().message() << "\n";
      return 1;
    }
    metrics = std::move(*endpoint);
  }
  if (!port_file.empty() && !WriteFileAtomically(port_file, std::to_string(port))) {
    std::cerr << "odyssey-controller: cannot write --port-file " << port_file << "\n";
    return 1;
  }
  if (metrics && !metrics_port_file.empty() && !WriteFileAtomically(metrics_port_file, std::to_string(metrics->port()))) {
    std::cerr << "odyssey-controller: cannot write --metrics-port-file " << metrics_port_file << "\n";
    return 1;
  }
  const std::string host = listen.substr(0, listen.rfind(':'));
  spdlog::info("odyssey-controller: serving gRPC on {}:{}, metrics {}, state {}", host, port,
               metrics ? absl::StrCat("http://", metrics_listen.substr(0, metrics_listen.rfind(':')), ":",
                                      metrics->port(), "/metrics")
                       : std::string("off"),
               db_path);

  // Liveness checks and scheduling.
  std::atomic<bool> stop{false};
  std::thread ticker([&] {
    while (!stop.load()) {
      (*controller)->Tick();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });

  int signal = 0;
  sigwait(&signals, &signal);
  spdlog::info("odyssey-controller: signal {}, shutting down", signal);
  stop = true;
  ticker.join();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  metrics.reset();
  spdlog::info("odyssey-controller: stopped");
  return 0;
}
