#include "common/metrics_endpoint.h"

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/version.h"
#include "prometheus/gauge.h"
#include "prometheus/text_serializer.h"

namespace odyssey {

absl::StatusOr<std::pair<std::string, int>> ParseHostPort(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("address \"", address, "\" must be host:port"));
  }
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  int port = 0;
  if (!absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("address \"", address, "\": port must be a number in [0, 65535]"));
  }
  if (host.empty()) host = "0.0.0.0";
  return std::make_pair(host, port);
}

void RegisterBuildInfo(prometheus::Registry& registry) {
  prometheus::BuildGauge()
      .Name("odyssey_build_info")
      .Help("Always 1; the labels name the binary's build (the version --version prints)")
      .Register(registry)
      .Add({{"version", ProjectVersion()}, {"revision", SourceRevision()}})
      .Set(1);
}

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Create(
    const std::string& listen, std::shared_ptr<prometheus::Registry> registry) {
  auto host_port = ParseHostPort(listen);
  if (!host_port.ok()) return host_port.status();
  const auto& [host, port] = *host_port;

  std::unique_ptr<MetricsEndpoint> endpoint(new MetricsEndpoint());
  endpoint->registry_ = std::move(registry);
  RegisterBuildInfo(*endpoint->registry_);
  endpoint->server_ = std::make_unique<httplib::Server>();
  // httplib's default also sets SO_REUSEPORT, which lets two processes bind one port
  // silently: a busy port must be an error.
  endpoint->server_->set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  prometheus::Registry* reg = endpoint->registry_.get();
  endpoint->server_->Get("/metrics", [reg](const httplib::Request&, httplib::Response& res) {
    std::ostringstream out;
    prometheus::TextSerializer().Serialize(out, reg->Collect());
    res.set_content(out.str(), "text/plain; version=0.0.4; charset=utf-8");
  });
  endpoint->server_->Get("/healthz", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("ok\n", "text/plain");
  });

  int bound = port;
  if (port == 0) {
    bound = endpoint->server_->bind_to_any_port(host);
    if (bound < 0) bound = 0;
  } else if (!endpoint->server_->bind_to_port(host, port)) {
    bound = 0;
  }
  if (bound <= 0) {
    return absl::UnavailableError(absl::StrCat("metrics endpoint cannot bind ", listen));
  }
  endpoint->port_ = bound;
  httplib::Server* server = endpoint->server_.get();
  auto done = std::make_shared<std::atomic<bool>>(false);
  endpoint->thread_ = std::thread([server, done] {
    server->listen_after_bind();
    done->store(true);
  });
  // httplib's stop() is a no-op until the accept loop runs: return only once it does, so the
  // destructor can always stop it (and a scrape right after Create is served).
  while (!server->is_running() && !done->load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return endpoint;
}

MetricsEndpoint::~MetricsEndpoint() {
  if (server_) server_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace odyssey
