#include "server/scheduler.h"

#include <algorithm>
#include <map>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace odyssey::server {

namespace {

std::string Workers(size_t n) { return absl::StrCat(n, n == 1 ? " worker" : " workers"); }

// "busy: w1 with jobs/7, w2 with jobs/8" (at most 4 named).
std::string BusyList(const Fleet* fleet) {
  if (!fleet || fleet->busy.empty()) return "";
  std::vector<std::string> parts;
  for (size_t i = 0; i < fleet->busy.size() && i < 4; ++i) {
    parts.push_back(absl::StrCat(fleet->busy[i].id, " with ", fleet->busy[i].job));
  }
  if (fleet->busy.size() > 4) parts.push_back(absl::StrCat(fleet->busy.size() - 4, " more"));
  return absl::StrCat(" (busy: ", absl::StrJoin(parts, ", "), ")");
}

}  // namespace

ScheduleDecision ScheduleGangs(std::vector<QueuedJob> queue, std::vector<IdleWorker> idle,
                               const std::function<absl::Status(int64_t id)>& admit, const Fleet* fleet) {
  ScheduleDecision out;
  const size_t attached = fleet ? static_cast<size_t>(std::max(fleet->attached, 0)) : idle.size();
  // Highest priority first, then oldest.
  std::sort(queue.begin(), queue.end(), [](const QueuedJob& a, const QueuedJob& b) {
    return a.priority != b.priority ? a.priority > b.priority : a.id < b.id;
  });
  std::sort(idle.begin(), idle.end(), [](const IdleWorker& a, const IdleWorker& b) { return a.id < b.id; });
  std::vector<const IdleWorker*> free;
  for (const IdleWorker& w : idle) free.push_back(&w);
  std::optional<int64_t> head;  // the first job that could run on the fleet but cannot start now
  std::string head_why;
  for (const QueuedJob& job : queue) {
    const size_t need = static_cast<size_t>(job.world_size);
    if (need > attached) {
      out.waiting.push_back({job.id,
                             absl::StrCat("needs ", Workers(need), ", ", attached,
                                          " attached: more than the attached fleet; it starts once enough workers "
                                          "attach and holds back no other job"),
                             true});
      continue;
    }
    if (head) {  // FIFO: nothing jumps the queue head
      out.waiting.push_back({job.id, absl::StrCat("queued behind ", "jobs/", *head, " (", head_why,
                                                  "); no backfill: server/README.md \"Scheduling\"")});
      continue;
    }
    if (free.size() < need) {  // gang: never partial
      head = job.id;
      head_why = absl::StrCat("needs ", Workers(need), ", ", free.size(), " idle");
      out.waiting.push_back({job.id, absl::StrCat(head_why, BusyList(fleet))});
      continue;
    }
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
