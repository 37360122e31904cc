// The gang scheduler: which queued jobs start now, and on which idle workers. Plain data in,
// plain data out: no state, no locking; the Controller gathers the queue and the idle workers
// under its mutex and applies the decision (Controller::Schedule).
//
// Rules (server/README.md, docs/architecture.md):
// - Queue order: highest priority first, then oldest (lowest id: ids grow with creation time).
// - Gangs: a job of world size W starts only when W idle workers exist; never a partial start.
// - Strict FIFO in that order: when the first job left cannot start, nothing behind it does (no
//   backfill), so a big job is never starved by a stream of small ones. Why no backfill: it is
//   safe only when a later job is known to end before the head could start, and nothing here
//   knows how long a job runs (an RL session runs until its client stops calling).
// - Except a job the attached fleet can never run (world size above the number of attached
//   workers): it waits for workers to attach, flagged, and holds back no other job.
// - Every job left waiting gets a reason (Job.pending_reason): "needs 2 workers, 1 idle (busy:
//   w1 with jobs/7)", "queued behind jobs/5 ...", "needs 4096 workers, 3 attached ...".
// - One host preferred (best fit): the host with the fewest idle workers that still holds W,
//   which keeps larger hosts whole for larger gangs (ties: the host first in name order); when
//   no host holds W, the workers of every host in host name order. Within a host, workers in
//   id order; rank r of the job is the r-th worker chosen.
// - A job that `admit` refuses neither starts nor takes workers: the jobs behind it are served
//   as if it were not queued. `admit` is asked only about a job that would start now (enough
//   idle workers), so a job behind a waiting head is not judged yet.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace odyssey::server {

struct QueuedJob {
  int64_t id = 0;
  int32_t priority = 0;
  int world_size = 1;  // workers the job needs. REQUIRES: >= 1
};

struct IdleWorker {
  std::string id;
  std::string host;
};

struct GangStart {
  int64_t job = 0;
  std::vector<std::string> workers;  // rank order
};

// The workers that are not idle, for the reasons (a worker returning or stopping counts busy).
struct BusyWorker {
  std::string id;
  std::string job;  // what it runs ("jobs/7"), or what it is doing ("returning")
};
struct Fleet {
  int attached = 0;  // every worker known (idle, busy, or reconnecting within the grace time)
  std::vector<BusyWorker> busy;
};

struct GangWait {
  int64_t job = 0;
  std::string reason;
  bool beyond_fleet = false;  // world size > attached workers: no attached fleet can run it
};

struct GangRefusal {
  int64_t job = 0;
  std::string why;  // admit's message
};

struct ScheduleDecision {
  std::vector<GangStart> starts;     // queue order
  std::vector<GangRefusal> refused;  // queue order
  std::vector<GangWait> waiting;     // queue order: every queued job that neither starts nor is refused
};

// Applies the rules above to `queue` (PENDING jobs, any order; ids unique) and `idle` (connected
// workers bound to no job, any order; ids unique). `admit` (may be null: every job admitted)
// returns OK when job `id` may start. `fleet` (may be null: the idle workers are the whole
// fleet) says how many workers are attached and what the others run.
ScheduleDecision ScheduleGangs(std::vector<QueuedJob> queue, std::vector<IdleWorker> idle,
                               const std::function<absl::Status(int64_t id)>& admit = nullptr,
                               const Fleet* fleet = nullptr);

}  // namespace odyssey::server
