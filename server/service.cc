#include "server/service.h"

#include <deque>
#include <thread>

#include "absl/strings/str_cat.h"
#include "server/auth.h"
#include "server/validation.h"
#include "spdlog/spdlog.h"

namespace odyssey::server {

namespace v1 = odyssey::v1;

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl and gRPC share the canonical code numbers.
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
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
    for (const char* m : {"CreateJob", "GetJob", "ListJobs", "CancelJob"}) Timer(m);
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
    if (event) {
      if (!writer->Write(*event)) break;
    } else if ((*watch)->done()) {
      break;
    }
  }
  return grpc::Status::OK;
}

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
  while (stream->Read(&message)) controller_->OnWorkerMessage(*session, message);
  controller_->DetachWorker(*session);
  connection->Shutdown();
  return grpc::Status::OK;
}

}  // namespace odyssey::server
