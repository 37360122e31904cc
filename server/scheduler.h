// The gang scheduler: which queued jobs start now, and on which idle workers. Plain data in,
// plain data out: no state, no locking; the Controller gathers the queue and the idle workers
// under its mutex and applies the decision (Controller::Schedule).
//
// Rules (server/README.md, docs/architecture.md):
// - Queue order: highest priority first, then oldest (lowest id: ids grow with creation time).
// - Gangs: a job of world size W starts only when W idle workers exist; never a partial start.
// - Strict FIFO in that order: when the first job left cannot start, nothing behind it does (no
//   backfill), so a big job is never starved by a stream of small ones.
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

struct GangRefusal {
  int64_t job = 0;
  std::string why;  // admit's message
};

struct ScheduleDecision {
  std::vector<GangStart> starts;     // queue order
  std::vector<GangRefusal> refused;  // queue order
};

// Applies the rules above to `queue` (PENDING jobs, any order; ids unique) and `idle` (connected
// workers bound to no job, any order; ids unique). `admit` (may be null: every job admitted)
// returns OK when job `id` may start.
ScheduleDecision ScheduleGangs(std::vector<QueuedJob> queue, std::vector<IdleWorker> idle,
                               const std::function<absl::Status(int64_t id)>& admit = nullptr);

}  // namespace odyssey::server
