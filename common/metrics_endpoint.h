// MetricsEndpoint: serves a prometheus-cpp Registry as Prometheus text at GET /metrics over
// HTTP (cpp-httplib + prometheus::TextSerializer).
//
// Why not prometheus-cpp's Exposer: its civetweb server cannot start worker threads in a
// process that links libtorch_cuda (DESIGN.md section 7). This class is what every odyssey
// process (controller, worker) uses instead. The header includes neither libtorch nor
// httplib nor spdlog, so libtorch translation units may include it.
//
// Thread safety: Create() starts one serving thread; the registry is read from it while other
// threads update metrics (prometheus-cpp metrics are thread-safe). port() may be called from
// any thread. The destructor stops the server and joins the thread.
#pragma once

#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "prometheus/registry.h"

namespace httplib {
class Server;
}

namespace odyssey {

class MetricsEndpoint {
 public:
  // Listens on `listen` ("host:port"; port 0 = any free port, see port()) and serves
  // `registry` at /metrics (and "ok" at /healthz). Fails when the address cannot be bound.
  // Adds odyssey_build_info to `registry` (RegisterBuildInfo), so every process serving
  // /metrics names its build.
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Create(
      const std::string& listen, std::shared_ptr<prometheus::Registry> registry);

  ~MetricsEndpoint();
  MetricsEndpoint(const MetricsEndpoint&) = delete;
  MetricsEndpoint& operator=(const MetricsEndpoint&) = delete;

  // The bound TCP port (the real one when 0 was asked for).
  int port() const { return port_; }

 private:
  MetricsEndpoint() = default;

  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  int port_ = 0;
};

// Adds the gauge odyssey_build_info{version, revision} = 1 (common/version.h) to `registry`;
// a second call changes nothing.
void RegisterBuildInfo(prometheus::Registry& registry);

// Splits "host:port" (IPv6 as "[::1]:port"); the port must be a number in [0, 65535].
absl::StatusOr<std::pair<std::string, int>> ParseHostPort(const std::string& address);

}  // namespace odyssey
