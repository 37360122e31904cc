// The gRPC edge of odyssey-controller: JobService and WorkerService handlers.
//
// Handlers are thin: authenticate the caller (auth.h: CallerTenant for JobService,
// AuthorizeWorker for WorkerService.Attach), validate the request (validation.h), call the
// Controller (which knows no gRPC) with the caller's tenant and convert its absl::Status once,
// here, with ToGrpcStatus. Every unary call is timed
// into odyssey_rpc_duration_seconds{method}.
//
// Thread safety: the services are called concurrently by gRPC's sync server threads; they hold
// no state of their own beyond metric handles. REQUIRES: the Controller outlives them.
#pragma once

#include <memory>

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"
#include "odyssey/v1/odyssey.grpc.pb.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "server/controller.h"

namespace odyssey::server {

grpc::Status ToGrpcStatus(const absl::Status& status);

// "ipv4:127.0.0.1:5000" -> "127.0.0.1"; "ipv6:[::1]:5000" -> "[::1]"; else "".
std::string PeerHost(const std::string& peer);

class JobServiceImpl final : public odyssey::v1::JobService::Service {
 public:
  // `registry` may be null (no metrics).
  JobServiceImpl(Controller* controller, prometheus::Registry* registry);

  grpc::Status CreateJob(grpc::ServerContext* context, const odyssey::v1::CreateJobRequest* request,
                         odyssey::v1::Job* response) override;
  grpc::Status GetJob(grpc::ServerContext* context, const odyssey::v1::GetJobRequest* request,
                      odyssey::v1::Job* response) override;
  grpc::Status ListJobs(grpc::ServerContext* context, const odyssey::v1::ListJobsRequest* request,
                        odyssey::v1::ListJobsResponse* response) override;
  grpc::Status CancelJob(grpc::ServerContext* context, const odyssey::v1::CancelJobRequest* request,
                         odyssey::v1::Job* response) override;
  grpc::Status WatchJob(grpc::ServerContext* context, const odyssey::v1::WatchJobRequest* request,
                        grpc::ServerWriter<odyssey::v1::JobEvent>* writer) override;

 private:
  prometheus::Histogram* Timer(const std::string& method);

  Controller* controller_;
  prometheus::Family<prometheus::Histogram>* rpc_duration_ = nullptr;
};

class WorkerServiceImpl final : public odyssey::v1::WorkerService::Service {
 public:
  explicit WorkerServiceImpl(Controller* controller) : controller_(controller) {}

  // The first message must be `hello`; then the stream carries the worker's messages in and
  // the controller's messages out (a writer thread drains a queue, so the controller never
  // blocks on a slow worker) until either side ends it.
  grpc::Status Attach(grpc::ServerContext* context,
                      grpc::ServerReaderWriter<odyssey::v1::ControllerMessage, odyssey::v1::WorkerMessage>*
                          stream) override;

 private:
  Controller* controller_;
};

}  // namespace odyssey::server
