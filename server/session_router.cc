// The session router: the TrainingService half of the Controller (Train). Pending calls
// (pending_calls_, by call_id), sequences (sequences_, by job), routing a call to its session's
// worker streams under mu_ and waiting with mu_ released, replies and their effects on the job.
// A multi-rank call's split and merge are rl_batch.h's. Controller member functions
// (controller.h).
#include "server/controller.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "server/rl_batch.h"
#include "server/validation.h"
#include "spdlog/spdlog.h"

namespace odyssey::server {

namespace v1 = odyssey::v1;

namespace {

const char* MethodName(v1::TrainingCall::CallCase c) {
  switch (c) {
    case v1::TrainingCall::kForwardBackward: return "ForwardBackward";
    case v1::TrainingCall::kOptimStep: return "OptimStep";
    case v1::TrainingCall::kForward: return "Forward";
    case v1::TrainingCall::kSaveCheckpoint: return "SaveCheckpoint";
    case v1::TrainingCall::kLoadCheckpoint: return "LoadCheckpoint";
    case v1::TrainingCall::kExportWeights: return "ExportWeights";
    case v1::TrainingCall::kSample: return "Sample";
    default: return "unknown";
  }
}

}  // namespace

void Controller::CountTrainingCall(const std::string& method, absl::StatusCode code) {
  metrics_.CountTrainingCall(method, code);
}

absl::Status Controller::CheckServesTraining(const v1::Job& job) {
  if (job.spec().kind() != v1::RL_SESSION) {
    return absl::FailedPreconditionError(
        absl::StrCat("job: ", job.name(), " is of kind ",
                     job.spec().kind() == v1::JOB_KIND_UNSPECIFIED ? "SFT" : v1::JobKind_Name(job.spec().kind()),
                     "; TrainingService calls need an RL_SESSION job"));
  }
  if (job.state() != v1::Job::RUNNING) {
    return absl::FailedPreconditionError(
        absl::StrCat("job: ", job.name(), " is ", v1::Job::State_Name(job.state()),
                     "; TrainingService calls need a RUNNING session",
                     job.state() == v1::Job::PENDING ? " (it waits for a worker; retry later)" : ""));
  }
  return absl::OkStatus();
}

absl::Status Controller::AwaitSequence(int64_t id, int64_t sequence, const std::function<bool()>& cancelled) {
  SequenceState& seq = sequences_[id];
  if (sequence < seq.next) {
    return absl::AlreadyExistsError(absl::StrCat("sequence: ", sequence, " was already received for ", JobName(id),
                                                 " (the next expected is ", seq.next, ")"));
  }
  if (seq.waiting.count(sequence)) {
    return absl::AlreadyExistsError(
        absl::StrCat("sequence: ", sequence, " is already waiting for its turn on ", JobName(id)));
  }
  if (sequence > seq.next) {
    seq.waiting.insert(sequence);
    metrics_.SetWaitingCalls(JobName(id), static_cast<int64_t>(seq.waiting.size()));
    const absl::Time deadline = absl::Now() + options_.sequence_wait;
    bool client_gone = false;
    auto turn = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      const v1::Job* job = FindJob(id);
      auto it = sequences_.find(id);  // erased when the job ends
      return !job || job->state() != v1::Job::RUNNING || it == sequences_.end() || it->second.next >= sequence;
    };
    while (!turn() && absl::Now() < deadline) {
      mu_.AwaitWithDeadline(absl::Condition(&turn), std::min(deadline, absl::Now() + absl::Seconds(1)));
      if (cancelled && cancelled()) {
        client_gone = true;
        break;
      }
    }
    // The session may have ended (and its sequence state been erased) while this call waited.
    auto it = sequences_.find(id);
    if (it != sequences_.end()) {
      it->second.waiting.erase(sequence);
      metrics_.SetWaitingCalls(JobName(id), static_cast<int64_t>(it->second.waiting.size()));
    }
    if (client_gone) return absl::CancelledError("the client cancelled the call while it waited for its turn");
    if (absl::Status s = CheckServesTraining(*FindJob(id)); !s.ok()) return s;
    const int64_t next = sequences_[id].next;
    if (next < sequence) {
      return absl::AbortedError(absl::StrCat("sequence: call ", sequence, " of ", JobName(id), " waited ",
                                             absl::FormatDuration(options_.sequence_wait), " for call ", next,
                                             ", which did not arrive; send the missing calls, then retry this one"));
    }
    if (next > sequence) {  // a duplicate of this sequence went first
      return absl::AlreadyExistsError(absl::StrCat("sequence: ", sequence, " was already received for ", JobName(id)));
    }
  }
  sequences_[id].next = sequence + 1;
  return absl::OkStatus();
}

absl::Status Controller::RefuseInTurn(int64_t id, int64_t sequence, const std::string& method,
                                      const absl::Status& refusal, const std::function<bool()>& cancelled) {
  absl::Status status = refusal;
  {
    absl::MutexLock lock(&mu_);
    const v1::Job* job = FindJob(id);
    if (sequence > 0 && job != nullptr && CheckServesTraining(*job).ok()) {
      if (absl::Status s = AwaitSequence(id, sequence, cancelled); !s.ok()) status = s;
    }
  }
  CountTrainingCall(method, status.code());
  return status;
}

absl::StatusOr<v1::TrainingReply> Controller::Train(int64_t id, v1::TrainingCall call, int64_t sequence,
                                                    const std::function<bool()>& cancelled) {
  const std::string method = MethodName(call.call_case());
  auto finish = [&](absl::StatusOr<v1::TrainingReply> r) {
    CountTrainingCall(method, r.status().code());
    return r;
  };
  absl::MutexLock lock(&mu_);
  const v1::Job* job = FindJob(id);
  if (!job) return finish(absl::NotFoundError(absl::StrCat("job: ", JobName(id), " does not exist")));
  if (absl::Status s = CheckServesTraining(*job); !s.ok()) return finish(s);
  // A sequenced call takes its turn before anything else can refuse it, so a refusal uses up its
  // number like an answer from the worker would and never leaves a gap behind it.
  if (sequence > 0) {
    if (absl::Status s = AwaitSequence(id, sequence, cancelled); !s.ok()) return finish(s);
    job = FindJob(id);
  }
  // The shard fields are the controller's to set (TrainingCall is internal; clear them anyway).
  call.clear_weight_sum();
  call.clear_datum_offset();
  if (job->workers_size() > 1) return finish(TrainRanks(id, std::move(call), sequence, cancelled));
  const int64_t positions = BatchPositions(call);
  const int64_t limit = RankPositionLimit(job->spec());
  if (positions > limit) {
    return finish(absl::InvalidArgumentError(absl::StrCat(
        "batch: ", positions, " token positions exceed the session's limit of ", limit,
        " (spec.data.seq_len ", job->spec().data().seq_len(), " x spec.data.batch_size ",
        std::max<int64_t>(1, job->spec().data().batch_size()), ", the memory the planner checked); split the batch")));
  }
  const std::string worker_id = job->workers_size() > 0 ? job->workers(0) : "";
  auto w = workers_.find(worker_id);
  if (w == workers_.end() || w->second.session == 0) {
    // Not forwarded: the sequence stays free for the retry (mu_ was held since AwaitSequence).
    if (sequence > 0) sequences_[id].next = sequence;
    return finish(absl::UnavailableError(absl::StrCat("job: the worker of ", job->name(), " (", worker_id,
                                                      ") is disconnected; retry once it is back or the job restarts")));
  }
  const int64_t call_id = next_call_id_++;
  call.set_call_id(call_id);
  call.set_job(job->name());
  auto pending = std::make_shared<PendingCall>();
  pending->job = id;
  pending->worker = worker_id;
  pending_calls_[call_id] = pending;
  v1::ControllerMessage message;
  *message.mutable_call() = std::move(call);
  SendTo(worker_id, message);
  // Waits with mu_ released: the reply, the worker's stream ending or the job ending sets done.
  bool client_gone = false;
  while (!pending->done) {
    mu_.AwaitWithTimeout(absl::Condition(&pending->done), absl::Seconds(1));
    if (!pending->done && cancelled && cancelled()) {
      client_gone = true;
      break;
    }
  }
  pending_calls_.erase(call_id);
  if (client_gone) {
    return finish(absl::CancelledError("the client cancelled the call; it may still run on the session's worker"));
  }
  if (!pending->status.ok()) return finish(pending->status);
  if (pending->reply.code() != 0) {
    return finish(absl::Status(static_cast<absl::StatusCode>(pending->reply.code()), pending->reply.message()));
  }
  return finish(std::move(pending->reply));
}

void Controller::OnReply(Worker& w, const v1::TrainingReply& reply) {
  auto it = pending_calls_.find(reply.call_id());
  if (it == pending_calls_.end() || it->second->worker != w.id || it->second->done) return;  // failed already
  PendingCall& pending = *it->second;
  pending.reply = reply;
  pending.done = true;
  if (!pending.part) ApplyReply(pending.job, reply);
}

void Controller::ApplyReply(int64_t id, const v1::TrainingReply& reply) {
  v1::Job* job = FindJob(id);
  if (reply.code() != 0 || !job) return;
  switch (reply.reply_case()) {
    case v1::TrainingReply::kForwardBackward: {
      const v1::ForwardBackwardResponse& fb = reply.forward_backward();
      job->set_loss(fb.loss());  // the whole batch's (OnProgress keeps it)
      metrics_.SetLoss(job->name(), fb.loss());
      if (fb.tokens() > 0) metrics_.AddTokens(fb.tokens());
      if (fb.mismatch_tokens() > 0) metrics_.SetMismatch(job->name(), fb.mismatch_mean(), fb.mismatch_max());
      break;
    }
    case v1::TrainingReply::kOptimStep:
      metrics_.SetOptimizerStep(job->name(), reply.optim_step().step());
      metrics_.SetOptimizerFigures(job->name(), reply.optim_step().grad_norm(), reply.optim_step().lr());
      break;
    case v1::TrainingReply::kLoadCheckpoint:
      metrics_.SetOptimizerStep(job->name(), reply.load_checkpoint().step());
      break;
    case v1::TrainingReply::kSaveCheckpoint: {
      // What a restart after a worker loss resumes from.
      const v1::SaveCheckpointResponse& save = reply.save_checkpoint();
      RecordCheckpoint(id, save.step(), save.directory());
      break;
    }
    default:
      break;
  }
}

absl::StatusOr<v1::TrainingReply> Controller::TrainRanks(int64_t id, v1::TrainingCall call, int64_t sequence,
                                                         const std::function<bool()>& cancelled) {
  const v1::Job& job = *FindJob(id);
  const v1::TrainingCall::CallCase kind = call.call_case();
  const int context_parallel = ContextParallelDegree(job.spec());  // `job` is not read after the wait
  // The ranks this call goes to, with their calls (rank order).
  absl::StatusOr<std::vector<RankCall>> split = SplitCall(std::move(call), job.workers_size(), job.spec());
  if (!split.ok()) return split.status();
  std::vector<RankCall>& targets = *split;
  for (const auto& [rank, rc] : targets) {
    auto w = workers_.find(job.workers(rank));
    if (w == workers_.end() || w->second.session == 0) {
      // Not forwarded to any rank: the sequence stays free for the retry.
      if (sequence > 0) sequences_[id].next = sequence;
      return absl::UnavailableError(absl::StrCat("job: the worker of rank ", rank, " of ", job.name(), " (",
                                                 job.workers(rank),
                                                 ") is disconnected; retry once it is back or the job restarts"));
    }
  }
  // Every rank's message is handed to its stream here, in one section under mu_: the ranks'
  // FIFOs see the session's calls in the same order, which the engine's collectives rely on.
  std::vector<int64_t> call_ids;
  std::vector<std::shared_ptr<PendingCall>> pendings;
  for (auto& [rank, rc] : targets) {
    const int64_t call_id = next_call_id_++;
    rc.set_call_id(call_id);
    rc.set_job(job.name());
    auto pending = std::make_shared<PendingCall>();
    pending->job = id;
    pending->worker = job.workers(rank);
    pending->part = true;
    pending_calls_[call_id] = pending;
    call_ids.push_back(call_id);
    pendings.push_back(pending);
    v1::ControllerMessage message;
    *message.mutable_call() = std::move(rc);
    SendTo(pending->worker, message);
  }
  // Waits with mu_ released for every reply, or for a rank failing without one (its stream
  // ended, the job ended): then the others' replies no longer matter.
  auto settled = [&pendings]() {
    bool all = true;
    for (const auto& p : pendings) {
      if (p->done && !p->status.ok()) return true;
      all = all && p->done;
    }
    return all;
  };
  bool client_gone = false;
  while (!settled()) {
    mu_.AwaitWithTimeout(absl::Condition(&settled), absl::Seconds(1));
    if (!settled() && cancelled && cancelled()) {
      client_gone = true;
      break;
    }
  }
  for (int64_t call_id : call_ids) pending_calls_.erase(call_id);
  if (client_gone) {
    return absl::CancelledError("the client cancelled the call; it may still run on the session's workers");
  }
  std::vector<v1::TrainingReply> replies;
  for (const auto& p : pendings) {
    if (p->done && !p->status.ok()) return p->status;
    replies.push_back(std::move(p->reply));
  }
  absl::StatusOr<v1::TrainingReply> merged = MergeReplies(kind, context_parallel, std::move(replies));
  if (!merged.ok()) return merged.status();
  ApplyReply(id, *merged);
  return merged;
}

void Controller::FailPendingCalls(int64_t id, const std::string& worker_id, const absl::Status& status) {
  for (auto& [call_id, pending] : pending_calls_) {
    if (pending->done || (id != 0 && pending->job != id) || (!worker_id.empty() && pending->worker != worker_id)) continue;
    pending->status = status;
    pending->done = true;
  }
}

int Controller::WaitingCalls(int64_t id) {
  absl::MutexLock lock(&mu_);
  auto it = sequences_.find(id);
  return it == sequences_.end() ? 0 : static_cast<int>(it->second.waiting.size());
}

}  // namespace odyssey::server
