// odyssey-controller: the job service. Flags are documented in server/README.md.
#include <signal.h>

#include <atomic>
#include <filesystem>
#include <iostream>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/metrics_endpoint.h"
#include "common/tls.h"
#include "common/version.h"
#include "grpc/health/v1/health.pb.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "server/auth.h"
#include "server/controller.h"
#include "server/paths.h"
#include "server/service.h"
#include "common/files.h"
#include "spdlog/spdlog.h"

int main(int argc, char** argv) {
  CLI::App app{"odyssey-controller: schedules training jobs onto attached odyssey-worker daemons"};
  app.set_version_flag("--version", odyssey::VersionLine("odyssey-controller"));
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
  std::string auth_token_file;
  odyssey::ServerTlsFiles tls;
  odyssey::server::PathPolicyOptions paths;
  double sequence_wait_s = 30;
  int max_threads = 1024;
  bool init_store = false;
  app.add_option("--listen", listen, "gRPC address host:port (port 0 = any free port, see --port-file)")
      ->capture_default_str();
  app.add_option("--port-file", port_file, "Write the bound gRPC port here (atomically) once serving");
  app.add_option("--state-dir", state_dir, "Folder of the SQLite job store (controller.db) and default checkpoints")
      ->capture_default_str();
  app.add_flag("--init-store", init_store,
               "Make an empty --state-dir/controller.db (0 bytes, or SQLite without tables) a new job store; "
               "without it such a file is refused (a missing one is always created; one with other content is "
               "never touched)");
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
  app.add_option("--max-threads", max_threads,
                 "Most threads serving gRPC calls: every open stream (a worker's Attach, a WatchJob) and every "
                 "call in progress (a TrainingService call waiting for its worker) holds one; beyond it new calls "
                 "get RESOURCE_EXHAUSTED instead of the process growing a thread per abandoned stream")
      ->capture_default_str()
      ->check(CLI::Range(16, 1 << 16));
  app.add_option("--rendezvous-port-base", rendezvous_port_base,
                 "Rank 0 of job N hosts its rendezvous on port base + N % 10000 (the window of ports stops at "
                 "65535)")
      ->capture_default_str()
      ->check(CLI::Range(1, 65535));
  app.add_option("--auth-token-file", auth_token_file,
                 "Bearer tokens: one '<token> <tenant>' per line (tenant @worker = worker tokens); "
                 "SIGHUP reloads it. Empty = auth off (one anonymous tenant)");
  app.add_option("--path-root", paths.root,
                 "Every path a client names (checkpoint and export folders, datasets, model folders) must lie "
                 "under this existing folder: under <root>/<tenant> with auth on, anywhere under it with auth off. "
                 "Empty = any absolute path (single-tenant / trusted deployments only)");
  app.add_option("--shared-read-root", paths.shared_read_roots,
                 "A folder every tenant may read but none may write (base models, datasets); repeatable. "
                 "Requires --path-root and must not contain it");
  app.add_option("--tls-cert", tls.cert, "PEM certificate chain of the gRPC port (with --tls-key: TLS on)");
  app.add_option("--tls-key", tls.key, "PEM private key of --tls-cert");
  app.add_option("--tls-client-ca", tls.client_ca,
                 "PEM CA bundle: clients must present a certificate it signed (mTLS); empty = not asked");
  CLI11_PARSE(app, argc, argv);

  // A peer that goes away mid-write (a /metrics scraper, a client) must not kill the process.
  signal(SIGPIPE, SIG_IGN);
  // Signals are taken by a sigwait thread; block them before any thread starts.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  // Credentials first: a bad --auth-token-file or TLS flag stops the process before it touches
  // the state or a port.
  if (!auth_token_file.empty()) {
    auto table = odyssey::server::TokenTable::Load(auth_token_file);
    if (!table.ok()) {
      std::cerr << "odyssey-controller: --auth-token-file: " << table.status().message() << "\n";
      return 1;
    }
    spdlog::info("odyssey-controller: auth on: {} tokens of {} tenants from {}", table->size(), table->tenants(),
                 auth_token_file);
    odyssey::server::SetAuthTokens(std::make_shared<const odyssey::server::TokenTable>(*std::move(table)));
  }
  auto path_policy = odyssey::server::PathPolicy::Create(paths);
  if (!path_policy.ok()) {
    std::cerr << "odyssey-controller: " << path_policy.status().message() << "\n";
    return 1;
  }
  if (path_policy->enabled()) {
    spdlog::info("odyssey-controller: client paths confined to {} ({}), shared read-only: {}", paths.root,
                 auth_token_file.empty() ? "auth off: the whole root" : "a folder per tenant",
                 paths.shared_read_roots.empty() ? std::string("none") : absl::StrJoin(paths.shared_read_roots, ", "));
  } else if (!auth_token_file.empty()) {
    spdlog::warn("odyssey-controller: auth is on but --path-root is not set: any tenant may make the workers read "
                 "or write any absolute path (other tenants' checkpoints included); set --path-root for "
                 "multi-tenant deployments");
  }
  auto credentials = odyssey::MakeServerCredentials(tls);
  if (!credentials.ok()) {
    std::cerr << "odyssey-controller: " << credentials.status().message() << "\n";
    return 1;
  }

  std::error_code ec;
  std::filesystem::create_directories(state_dir, ec);
  if (ec) {
    std::cerr << "odyssey-controller: cannot create --state-dir " << state_dir << ": " << ec.message() << "\n";
    return 1;
  }
  const std::string db_path = (std::filesystem::path(state_dir) / "controller.db").string();
  auto store = odyssey::server::JobStore::Open(db_path, init_store);
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
  options.paths = *std::move(path_policy);
  auto controller = odyssey::server::Controller::Create(options, std::move(*store));
  if (!controller.ok()) {
    std::cerr << "odyssey-controller: " << controller.status().message() << "\n";
    return 1;
  }

  odyssey::server::JobServiceImpl job_service(controller->get(), registry.get());
  odyssey::server::TrainingServiceImpl training_service(controller->get(), registry.get());
  odyssey::server::WorkerServiceImpl worker_service(controller->get());
  odyssey::server::PlannerServiceImpl planner_service(controller->get());
  grpc::EnableDefaultHealthCheckService(true);
  // gRPC's default health service has no protobuf descriptor: referencing the generated
  // grpc.health.v1 messages links their file into the descriptor pool that reflection reads, so
  // `grpcurl -plaintext HOST:PORT grpc.health.v1.Health/Check` needs no -proto.
  (void)grpc::health::v1::HealthCheckResponse::descriptor();
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(listen, *credentials, &port);
  builder.SetMaxReceiveMessageSize(static_cast<int>(max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(max_message_bytes));
  builder.RegisterService(&job_service);
  builder.RegisterService(&training_service);
  builder.RegisterService(&worker_service);
  builder.RegisterService(&planner_service);
  grpc::ResourceQuota quota("odyssey-controller");
  quota.SetMaxThreads(max_threads);  // the sync server answers RESOURCE_EXHAUSTED past it
  builder.SetResourceQuota(quota);
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
  if (!port_file.empty()) {
    if (absl::Status s = odyssey::WriteFileAtomically(port_file, std::to_string(port) + "\n"); !s.ok()) {
      std::cerr << "odyssey-controller: --port-file: " << s.message() << "\n";
      return 1;
    }
  }
  if (metrics && !metrics_port_file.empty()) {
    if (absl::Status s = odyssey::WriteFileAtomically(metrics_port_file, std::to_string(metrics->port()) + "\n");
        !s.ok()) {
      std::cerr << "odyssey-controller: --metrics-port-file: " << s.message() << "\n";
      return 1;
    }
  }
  const std::string host = listen.substr(0, listen.rfind(':'));
  spdlog::info("odyssey-controller: serving gRPC ({}, auth {}) on {}:{}, metrics {}, state {}",
               tls.cert.empty() ? "plaintext" : (tls.client_ca.empty() ? "TLS" : "mTLS"),
               auth_token_file.empty() ? "off" : "on", host, port,
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
  while (true) {
    sigwait(&signals, &signal);
    if (signal != SIGHUP) break;
    // Reload the token file; a broken file keeps the tokens in force (never auth off by accident).
    if (auth_token_file.empty()) {
      spdlog::info("odyssey-controller: SIGHUP: no --auth-token-file, nothing to reload");
      continue;
    }
    auto table = odyssey::server::TokenTable::Load(auth_token_file);
    if (!table.ok()) {
      spdlog::error("odyssey-controller: SIGHUP: keeping the current tokens: --auth-token-file: {}",
                    std::string(table.status().message()));
      continue;
    }
    spdlog::info("odyssey-controller: SIGHUP: reloaded {} tokens of {} tenants from {}", table->size(),
                 table->tenants(), auth_token_file);
    odyssey::server::SetAuthTokens(std::make_shared<const odyssey::server::TokenTable>(*std::move(table)));
  }
  spdlog::info("odyssey-controller: signal {}, shutting down", signal);
  stop = true;
  ticker.join();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  metrics.reset();
  spdlog::info("odyssey-controller: stopped");
  return 0;
}
