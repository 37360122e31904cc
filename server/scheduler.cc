#include "server/scheduler.h"

#include <algorithm>
#include <map>

namespace odyssey::server {

ScheduleDecision ScheduleGangs(std::vector<QueuedJob> queue, std::vector<IdleWorker> idle,
                               const std::function<absl::Status(int64_t id)>& admit) {
  ScheduleDecision out;
  // Highest priority first, then oldest.
  std::sort(queue.begin(), queue.end(), [](const QueuedJob& a, const QueuedJob& b) {
    return a.priority != b.priority ? a.priority > b.priority : a.id < b.id;
  });
  std::sort(idle.begin(), idle.end(), [](const IdleWorker& a, const IdleWorker& b) { return a.id < b.id; });
  std::vector<const IdleWorker*> free;
  for (const IdleWorker& w : idle) free.push_back(&w);
  for (const QueuedJob& job : queue) {
    const size_t need = static_cast<size_t>(job.world_size);
    if (free.size() < need) break;  // gang: never partial; FIFO: nothing jumps the queue head
    if (admit) {
      if (absl::Status s = admit(job.id); !s.ok()) {
        out.refused.push_back({job.id, std::string(s.message())});
        continue;
      }
    }
    // Prefer one host: the host with the fewest idle workers that still fits the job.
    std::map<std::string, std::vector<const IdleWorker*>> by_host;
    for (const IdleWorker* w : free) by_host[w->host].push_back(w);
    const std::vector<const IdleWorker*>* best = nullptr;
    for (const auto& [host, ws] : by_host) {
      if (ws.size() >= need && (!best || ws.size() < best->size())) best = &ws;
    }
    std::vector<const IdleWorker*> chosen;
    if (best) {
      chosen.assign(best->begin(), best->begin() + static_cast<std::ptrdiff_t>(need));
    } else {
      for (const auto& [host, ws] : by_host) {
        for (const IdleWorker* w : ws) {
          if (chosen.size() < need) chosen.push_back(w);
        }
      }
    }
    GangStart start{job.id, {}};
    for (const IdleWorker* w : chosen) {
      start.workers.push_back(w->id);
      free.erase(std::find(free.begin(), free.end(), w));
    }
    out.starts.push_back(std::move(start));
  }
  return out;
}

}  // namespace odyssey::server
