#include "server/service.h"

#include <deque>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/wire_text.h"
#include "server/auth.h"
#include "server/validation.h"
#include "spdlog/spdlog.h"

namespace odyssey::server {

namespace v1 = odyssey::v1;

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // Valid UTF-8, bounded, no stack traces (common/wire_text.h); the full text goes to the log.
  std::string text = WireText(status.message());
  if (text != status.message()) {
    spdlog::info("status shortened for the caller ({} of {} bytes); full text: {}", text.size(),
                 status.message().size(), ValidUtf8(status.message()));
  }
  // absl and gRPC share the canonical code numbers.
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::move(text));
}

std::string PeerHost(const std::string& peer) {
  const size_t scheme = peer.find(':');
  const size_t port = peer.rfind(':');
  if (scheme == std::string::npos || port == scheme) return "";
  const std::string kind = peer.substr(0, scheme);
  if (kind != "ipv4" && kind != "ipv6") return "";
  return peer.substr(scheme + 1, port - scheme - 1);
}

namespace {

// Times one unary call into a histogram when it goes out of scope.
class ScopedTimer {
 public:
  explicit ScopedTimer(prometheus::Histogram* h) : h_(h), start_(absl::Now()) {}
  ~ScopedTimer() {
    if (h_) h_->Observe(absl::ToDoubleSeconds(absl::Now() - start_));
  }

 private:
  prometheus::Histogram* h_;
  absl::Time start_;
};

}  // namespace

JobServiceImpl::JobServiceImpl(Controller* controller, prometheus::Registry* registry)
    : controller_(controller) {
  if (registry) {
    rpc_duration_ = &prometheus::BuildHistogram()
                         .Name("odyssey_rpc_duration_seconds")
                         .Help("Server-side duration of unary JobService calls")
                         .Register(*registry);
    for (const char* m : {"CreateJob", "GetJob", "ListJobs", "CancelJob", "ListJobEvents"}) Timer(m);
  }
}

prometheus::Histogram* JobServiceImpl::Timer(const std::string& method) {
  if (!rpc_duration_) return nullptr;
  return &rpc_duration_->Add({{"method", method}},
                             prometheus::Histogram::BucketBoundaries{0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03,
                                                                     0.1, 0.3, 1, 3});
}

grpc::Status JobServiceImpl::CreateJob(grpc::ServerContext* context, const v1::CreateJobRequest* request,
                                       v1::Job* response) {
  ScopedTimer timer(Timer("CreateJob"));
  auto tenant = CallerTenant(*context);
  if (!tenant.ok()) return ToGrpcStatus(tenant.status());
  // Paths before validation: validation reads the model and dataset files it names.
  if (absl::Status s = controller_->CheckPaths(request->spec(), *tenant); !s.ok()) return ToGrpcStatus(s);
  if (absl::Status s = ValidateCreateJobRequest(*request); !s.ok()) return ToGrpcStatus(s);
  auto job = controller_->CreateJob(*request, *tenant);
  if (!job.ok()) return ToGrpcStatus(job.status());
  *response = std::move(*job);
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::GetJob(grpc::ServerContext* context, const v1::GetJobRequest* request,
                                    v1::Job* response) {
  ScopedTimer timer(Timer("GetJob"));
  auto tenant = CallerTenant(*context);
  if (!tenant.ok()) return ToGrpcStatus(tenant.status());
  auto id = ParseJobName(request->name());
  if (!id.ok()) return ToGrpcStatus(id.status());
  auto job = controller_->GetJob(*id, *tenant);
  if (!job.ok()) return ToGrpcStatus(job.status());
  *response = std::move(*job);
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::ListJobs(grpc::ServerContext* context, const v1::ListJobsRequest* request,
                                      v1::ListJobsResponse* response) {
  ScopedTimer timer(Timer("ListJobs"));
  auto tenant = CallerTenant(*context);
  if (!tenant.ok()) return ToGrpcStatus(tenant.status());
  if (absl::Status s = ValidateListJobsRequest(*request); !s.ok()) return ToGrpcStatus(s);
  auto list = controller_->ListJobs(*request, *tenant);
  if (!list.ok()) return ToGrpcStatus(list.status());
  *response = std::move(*list);
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::CancelJob(grpc::ServerContext* context, const v1::CancelJobRequest* request,
                                       v1::Job* response) {
  ScopedTimer timer(Timer("CancelJob"));
  auto tenant = CallerTenant(*context);
  if (!tenant.ok()) return ToGrpcStatus(tenant.status());
  auto id = ParseJobName(request->name());
  if (!id.ok()) return ToGrpcStatus(id.status());
  auto job = controller_->CancelJob(*id, *tenant);
  if (!job.ok()) return ToGrpcStatus(job.status());
  *response = std::move(*job);
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::ListJobEvents(grpc::ServerContext* context, const v1::ListJobEventsRequest* request,
                                           v1::ListJobEventsResponse* response) {
  ScopedTimer timer(Timer("ListJobEvents"));
  auto tenant = CallerTenant(*context);
  if (!tenant.ok()) return ToGrpcStatus(tenant.status());
  auto id = ParseJobName(request->name());
  if (!id.ok()) return ToGrpcStatus(id.status());
  if (absl::Status s = ValidateListJobEventsRequest(*request); !s.ok()) return ToGrpcStatus(s);
  auto page = controller_->ListJobEvents(*id, *request, *tenant);
  if (!page.ok()) return ToGrpcStatus(page.status());
  *response = std::move(*page);
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::WatchJob(grpc::ServerContext* context, const v1::WatchJobRequest* request,
                                      grpc::ServerWriter<v1::JobEvent>* writer) {
  auto tenant = CallerTenant(*context);
  if (!tenant.ok()) return ToGrpcStatus(tenant.status());
  auto id = ParseJobName(request->name());
  if (!id.ok()) return ToGrpcStatus(id.status());
  auto watch = controller_->WatchJob(*id, *tenant);
  if (!watch.ok()) return ToGrpcStatus(watch.status());
  while (!context->IsCancelled()) {
    std::optional<v1::JobEvent> event = (*watch)->Next(absl::Milliseconds(250));
    // A token revoked (or moved to another tenant) by a reload ends the watch within 250 ms.
    if (absl::Status s = StillAuthorized(*context, *tenant); !s.ok()) return ToGrpcStatus(s);
    if (event) {
      if (!writer->Write(*event)) break;
    } else if ((*watch)->done()) {
      break;
    }
  }
  return grpc::Status::OK;
}

// ---------------------------------------------------------------------------------------------
// TrainingService

TrainingServiceImpl::TrainingServiceImpl(Controller* controller, prometheus::Registry* registry)
    : controller_(controller) {
  if (registry) {
    call_duration_ = &prometheus::BuildHistogram()
                          .Name("odyssey_training_call_duration_seconds")
                          .Help("Server-side duration of TrainingService calls, from arrival to reply: waiting for "
                                "earlier calls of the session and the workers' compute included")
                          .Register(*registry);
    for (const char* m : {"ForwardBackward", "OptimStep", "Forward", "SaveCheckpoint", "LoadCheckpoint",
                          "ExportWeights", "Sample"}) {
      Timer(m);
    }
  }
}

prometheus::Histogram* TrainingServiceImpl::Timer(const std::string& method) {
  if (!call_duration_) return nullptr;
  return &call_duration_->Add({{"method", method}},
                              prometheus::Histogram::BucketBoundaries{0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10,
                                                                      30, 100, 300, 1000});
}

absl::StatusOr<v1::TrainingReply> TrainingServiceImpl::Route(grpc::ServerContext* context, const char* method,
                                                               const absl::Status& valid, const std::string& job,
                                                               int64_t sequence, v1::TrainingCall call) {
  ScopedTimer timer(Timer(method));
  // Who is calling comes first (an unauthenticated caller learns nothing about its request),
  // then the request's own rules, then whether the job is the caller's, then whether the
  // caller may name the call's directory (server/paths.h).
  auto tenant = CallerTenant(*context);
  if (!tenant.ok()) {
    controller_->CountTrainingCall(method, tenant.status().code());
    return tenant.status();
  }
  auto id = ParseJobName(job, "job");
  if (!valid.ok()) {
    // A refused call whose job and sequence are sound still takes its turn (Controller::
    // RefuseInTurn), so the caller's later sequenced calls do not wait on a number never used.
    if (id.ok() && sequence > 0 && controller_->CheckJobAccess(*id, *tenant, "job").ok()) {
      return controller_->RefuseInTurn(*id, sequence, method, valid,
                                       [context] { return context->IsCancelled(); });
    }
    controller_->CountTrainingCall(method, valid.code());
    return valid;
  }
  if (absl::Status access = controller_->CheckJobAccess(*id, *tenant, "job"); !access.ok()) {
    controller_->CountTrainingCall(method, access.code());
    return access;
  }
  if (absl::Status paths = controller_->CheckPaths(call, *tenant); !paths.ok()) {
    // Like a request that fails validation: a sequenced call still takes its turn.
    if (sequence > 0) {
      return controller_->RefuseInTurn(*id, sequence, method, paths, [context] { return context->IsCancelled(); });
    }
    controller_->CountTrainingCall(method, paths.code());
    return paths;
  }
  return controller_->Train(*id, std::move(call), sequence, [context] { return context->IsCancelled(); });
}

template <typename Request, typename Response>
grpc::Status TrainingServiceImpl::Unary(grpc::ServerContext* context, const char* method, const Request& request,
                                        absl::Status (*validate)(const Request&),
                                        Request* (v1::TrainingCall::*call_field)(),
                                        Response* (v1::TrainingReply::*reply_field)(), Response* response) {
  v1::TrainingCall call;
  const absl::Status valid = validate(request);
  if (valid.ok()) *(call.*call_field)() = request;
  auto reply = Route(context, method, valid, request.job(), request.sequence(), std::move(call));
  if (!reply.ok()) return ToGrpcStatus(reply.status());
  *response = std::move(*((*reply).*reply_field)());
  return grpc::Status::OK;
}

grpc::Status TrainingServiceImpl::ForwardBackward(grpc::ServerContext* context, const v1::ForwardBackwardRequest* request,
                                 v1::ForwardBackwardResponse* response) {
  return Unary(context, "ForwardBackward", *request, &ValidateForwardBackwardRequest, &v1::TrainingCall::mutable_forward_backward,
               &v1::TrainingReply::mutable_forward_backward, response);
}

grpc::Status TrainingServiceImpl::OptimStep(grpc::ServerContext* context, const v1::OptimStepRequest* request,
                                 v1::OptimStepResponse* response) {
  return Unary(context, "OptimStep", *request, &ValidateOptimStepRequest, &v1::TrainingCall::mutable_optim_step,
               &v1::TrainingReply::mutable_optim_step, response);
}

grpc::Status TrainingServiceImpl::Forward(grpc::ServerContext* context, const v1::ForwardRequest* request,
                                 v1::ForwardResponse* response) {
  return Unary(context, "Forward", *request, &ValidateForwardRequest, &v1::TrainingCall::mutable_forward,
               &v1::TrainingReply::mutable_forward, response);
}

grpc::Status TrainingServiceImpl::SaveCheckpoint(grpc::ServerContext* context, const v1::SaveCheckpointRequest* request,
                                 v1::SaveCheckpointResponse* response) {
  return Unary(context, "SaveCheckpoint", *request, &ValidateSaveCheckpointRequest, &v1::TrainingCall::mutable_save_checkpoint,
               &v1::TrainingReply::mutable_save_checkpoint, response);
}

grpc::Status TrainingServiceImpl::LoadCheckpoint(grpc::ServerContext* context, const v1::LoadCheckpointRequest* request,
                                 v1::LoadCheckpointResponse* response) {
  return Unary(context, "LoadCheckpoint", *request, &ValidateLoadCheckpointRequest, &v1::TrainingCall::mutable_load_checkpoint,
               &v1::TrainingReply::mutable_load_checkpoint, response);
}

grpc::Status TrainingServiceImpl::ExportWeights(grpc::ServerContext* context, const v1::ExportWeightsRequest* request,
                                 v1::ExportWeightsResponse* response) {
  return Unary(context, "ExportWeights", *request, &ValidateExportWeightsRequest, &v1::TrainingCall::mutable_export_weights,
               &v1::TrainingReply::mutable_export_weights, response);
}

grpc::Status TrainingServiceImpl::Sample(grpc::ServerContext* context, const v1::SampleRequest* request,
                                          v1::SampleResponse* response) {
  return Unary(context, "Sample", *request, &ValidateSampleRequest, &v1::TrainingCall::mutable_sample,
               &v1::TrainingReply::mutable_sample, response);
}

grpc::Status TrainingServiceImpl::PushRollouts(grpc::ServerContext* context,
                                               grpc::ServerReaderWriter<v1::RolloutResult, v1::RolloutBatch>* stream) {
  v1::RolloutBatch batch;
  for (int64_t index = 0; stream->Read(&batch); ++index) {
    const absl::Status valid = ValidateRolloutBatch(batch);
    auto with_index = [index](const absl::Status& s) {
      return ToGrpcStatus(absl::Status(s.code(), absl::StrCat("rollout batch ", index, ": ", s.message())));
    };
    v1::TrainingCall fb;
    if (valid.ok()) {
      v1::ForwardBackwardRequest* r = fb.mutable_forward_backward();
      r->set_job(batch.job());
      *r->mutable_batch() = std::move(*batch.mutable_batch());
      *r->mutable_loss() = batch.loss();
    }
    auto fb_reply = Route(context, "ForwardBackward", valid, batch.job(), 0, std::move(fb));
    if (!fb_reply.ok()) return with_index(fb_reply.status());
    v1::TrainingCall os;
    v1::OptimStepRequest* r = os.mutable_optim_step();
    r->set_job(batch.job());
    *r->mutable_adam() = batch.adam();
    auto os_reply = Route(context, "OptimStep", absl::OkStatus(), batch.job(), 0, std::move(os));
    if (!os_reply.ok()) return with_index(os_reply.status());
    v1::RolloutResult result;
    *result.mutable_forward_backward() = std::move(*fb_reply->mutable_forward_backward());
    *result.mutable_optim_step() = std::move(*os_reply->mutable_optim_step());
    if (!stream->Write(result)) break;  // the client went away
  }
  return grpc::Status::OK;
}

// ---------------------------------------------------------------------------------------------
// PlannerService

grpc::Status PlannerServiceImpl::Plan(grpc::ServerContext* context, const v1::PlanRequest* request,
                                      v1::PlanResponse* response) {
  auto tenant = CallerTenant(*context);
  if (!tenant.ok()) return ToGrpcStatus(tenant.status());
  // Paths before validation, as for CreateJob: validation reads the files the spec names.
  if (absl::Status s = controller_->CheckPaths(request->spec(), *tenant); !s.ok()) return ToGrpcStatus(s);
  if (absl::Status s = ValidatePlanRequest(*request); !s.ok()) return ToGrpcStatus(s);
  auto plan = controller_->Plan(*request);
  if (!plan.ok()) return ToGrpcStatus(plan.status());
  *response = std::move(*plan);
  return grpc::Status::OK;
}

// ---------------------------------------------------------------------------------------------
// WorkerService

namespace {

using AttachStream = grpc::ServerReaderWriter<v1::ControllerMessage, v1::WorkerMessage>;

// One Attach stream as the controller sees it: Send() queues, a writer thread writes.
class StreamConnection final : public WorkerConnection {
 public:
  StreamConnection(grpc::ServerContext* context, AttachStream* stream) : context_(context), stream_(stream) {
    writer_ = std::thread([this] { WriteLoop(); });
  }
  ~StreamConnection() override { Shutdown(); }

  void Send(const v1::ControllerMessage& message) override {
    absl::MutexLock lock(&mu_);
    if (!stopped_) queue_.push_back(message);
  }

  void Close() override {
    absl::MutexLock lock(&mu_);
    if (context_) context_->TryCancel();
  }

  // Stops the writer; after this, Close() no longer touches the (ending) call.
  void Shutdown() {
    {
      absl::MutexLock lock(&mu_);
      stopped_ = true;
      context_ = nullptr;
    }
    if (writer_.joinable()) writer_.join();
  }

 private:
  void WriteLoop() {
    while (true) {
      v1::ControllerMessage message;
      {
        absl::MutexLock lock(&mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopped_ || !queue_.empty(); };
        mu_.Await(absl::Condition(&ready));
        if (stopped_) return;
        message = std::move(queue_.front());
        queue_.pop_front();
      }
      if (!stream_->Write(message)) {
        absl::MutexLock lock(&mu_);
        if (context_) context_->TryCancel();  // the reader then ends the call
        return;
      }
    }
  }

  absl::Mutex mu_;
  grpc::ServerContext* context_ ABSL_GUARDED_BY(mu_);
  AttachStream* const stream_;
  std::deque<v1::ControllerMessage> queue_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::thread writer_;
};

}  // namespace

grpc::Status WorkerServiceImpl::Attach(grpc::ServerContext* context, AttachStream* stream) {
  if (absl::Status s = AuthorizeWorker(*context); !s.ok()) return ToGrpcStatus(s);
  v1::WorkerMessage first;
  if (!stream->Read(&first)) return grpc::Status::OK;
  if (!first.has_hello()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "hello: the first message of Attach must be hello (WorkerCapabilities)");
  }
  auto connection = std::make_shared<StreamConnection>(context, stream);
  auto session = controller_->AttachWorker(first.hello(), PeerHost(context->peer()), connection);
  if (!session.ok()) {
    connection->Shutdown();
    return ToGrpcStatus(session.status());
  }
  v1::WorkerMessage message;
  grpc::Status status = grpc::Status::OK;
  while (stream->Read(&message)) {
    // A worker token revoked by a reload detaches the worker at its next message (heartbeats
    // come every few seconds); its jobs are then handled as after any worker loss.
    if (absl::Status s = StillAuthorized(*context, kWorkerTenant); !s.ok()) {
      status = ToGrpcStatus(s);
      break;
    }
    controller_->OnWorkerMessage(*session, message);
  }
  controller_->DetachWorker(*session);
  connection->Shutdown();
  return status;
}

}  // namespace odyssey::server
