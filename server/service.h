// The gRPC edge of odyssey-controller: JobService, TrainingService and WorkerService handlers.
//
// Handlers are thin: authenticate the caller (auth.h: CallerTenant for JobService,
// AuthorizeWorker for WorkerService.Attach), validate the request (validation.h), call the
// Controller (which knows no gRPC) with the caller's tenant and convert its absl::Status once,
// here, with ToGrpcStatus. Every unary JobService call is timed into
// odyssey_rpc_duration_seconds{method}, every TrainingService call (each PushRollouts batch as
// its ForwardBackward and its OptimStep) into odyssey_training_call_duration_seconds{method}.
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
  grpc::Status ListJobEvents(grpc::ServerContext* context, const odyssey::v1::ListJobEventsRequest* request,
                             odyssey::v1::ListJobEventsResponse* response) override;
  grpc::Status WatchJob(grpc::ServerContext* context, const odyssey::v1::WatchJobRequest* request,
                        grpc::ServerWriter<odyssey::v1::JobEvent>* writer) override;

 private:
  prometheus::Histogram* Timer(const std::string& method);

  Controller* controller_;
  prometheus::Family<prometheus::Histogram>* rpc_duration_ = nullptr;
};

// TrainingService: each unary call is validated (validation.h), forwarded by
// Controller::Train to the session's worker, and its reply unpacked. Rejections before the core
// are counted in odyssey_training_calls_total as well. A call whose client goes away stops
// waiting (the call may still run on the worker).
class TrainingServiceImpl final : public odyssey::v1::TrainingService::Service {
 public:
  // `registry` may be null (no latency histogram).
  explicit TrainingServiceImpl(Controller* controller, prometheus::Registry* registry = nullptr);

  grpc::Status ForwardBackward(grpc::ServerContext* context, const odyssey::v1::ForwardBackwardRequest* request,
                               odyssey::v1::ForwardBackwardResponse* response) override;
  grpc::Status OptimStep(grpc::ServerContext* context, const odyssey::v1::OptimStepRequest* request,
                         odyssey::v1::OptimStepResponse* response) override;
  grpc::Status Forward(grpc::ServerContext* context, const odyssey::v1::ForwardRequest* request,
                       odyssey::v1::ForwardResponse* response) override;
  grpc::Status SaveCheckpoint(grpc::ServerContext* context, const odyssey::v1::SaveCheckpointRequest* request,
                              odyssey::v1::SaveCheckpointResponse* response) override;
  grpc::Status LoadCheckpoint(grpc::ServerContext* context, const odyssey::v1::LoadCheckpointRequest* request,
                              odyssey::v1::LoadCheckpointResponse* response) override;
  grpc::Status ExportWeights(grpc::ServerContext* context, const odyssey::v1::ExportWeightsRequest* request,
                             odyssey::v1::ExportWeightsResponse* response) override;
  grpc::Status Sample(grpc::ServerContext* context, const odyssey::v1::SampleRequest* request,
                      odyssey::v1::SampleResponse* response) override;
  // Batches are taken one at a time: ForwardBackward, then OptimStep, then the result is
  // written, then the next batch is read. The first failing batch ends the stream with its
  // status (its ForwardBackward's or OptimStep's); results already written stand.
  grpc::Status PushRollouts(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<odyssey::v1::RolloutResult, odyssey::v1::RolloutBatch>* stream) override;

 private:
  // The six unary calls differ only in their request type, its validator and the oneof fields
  // of TrainingCall / TrainingReply they fill: validate, Route, copy the reply's field out.
  template <typename Request, typename Response>
  grpc::Status Unary(grpc::ServerContext* context, const char* method, const Request& request,
                     absl::Status (*validate)(const Request&),
                     Request* (odyssey::v1::TrainingCall::*call_field)(),
                     Response* (odyssey::v1::TrainingReply::*reply_field)(), Response* response);
  // Validation result `valid` for `method`; then forwards `call` for `job` and returns the reply.
  absl::StatusOr<odyssey::v1::TrainingReply> Route(grpc::ServerContext* context, const char* method,
                                                     const absl::Status& valid, const std::string& job,
                                                     int64_t sequence, odyssey::v1::TrainingCall call);
  // odyssey_training_call_duration_seconds{method}; null without a registry.
  prometheus::Histogram* Timer(const std::string& method);

  Controller* controller_;
  prometheus::Family<prometheus::Histogram>* call_duration_ = nullptr;
};

// PlannerService: any tenant may ask (auth as for JobService; the spec's paths under the same
// rules as CreateJob, since planning reads the model's config.json).
class PlannerServiceImpl final : public odyssey::v1::PlannerService::Service {
 public:
  explicit PlannerServiceImpl(Controller* controller) : controller_(controller) {}

  grpc::Status Plan(grpc::ServerContext* context, const odyssey::v1::PlanRequest* request,
                    odyssey::v1::PlanResponse* response) override;

 private:
  Controller* controller_;
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
