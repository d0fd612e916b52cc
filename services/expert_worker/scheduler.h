// The worker's batcher: requests of every stream for the same layer are batched together
// (continuous batching: a batch waits at most `batch_window` for company and holds at most
// `max_batch_tokens` tokens) and run on the backend by one executor thread.
//
// Long prefills never starve decode: a request with more than `long_prefill_tokens` tokens is cut
// into chunks of that size, queued apart from the small requests; the executor prefers small
// requests and runs one chunk batch at least every `chunk_every` batches while small ones wait,
// so a small request waits at most about one chunk's compute. Deadlines are checked while queued
// and before each batch; requests of cancelled streams are dropped (completed as CANCELLED).
//
//   Scheduler sched(opts, backend, metrics, hidden_size);
//   sched.Start();
//   absl::Status s = sched.Submit(request);   // RESOURCE_EXHAUSTED when max_queue requests wait
//   ... every submitted request's sink->Complete is called exactly once ...
//   sched.Stop();                              // completes what is still queued as UNAVAILABLE
#pragma once

#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "services/expert_worker/backend.h"
#include "services/expert_worker/request.h"
#include "services/expert_worker/worker_metrics.h"

namespace exl3::worker {

struct SchedulerOptions {
  std::chrono::microseconds batch_window{50};
  int max_batch_tokens = 4096;
  int long_prefill_tokens = 1024;  // requests above this are chunked into pieces of this size
  int max_queue = 1024;            // requests waiting (not yet started) at most
  int chunk_every = 2;             // with small requests waiting, 1 chunk batch per this many batches
};

class Scheduler {
 public:
  Scheduler(const SchedulerOptions& opt, MoeBackend* backend, WorkerMetrics* metrics, int hidden);
  ~Scheduler();

  void Start();
  // Queues `r` (validated). Fails with RESOURCE_EXHAUSTED when max_queue requests already wait,
  // UNAVAILABLE after Stop. On failure the caller answers the request itself.
  absl::Status Submit(std::shared_ptr<WorkRequest> r);
  // Requests submitted and not yet completed.
  int InFlight() const;
  // Stops the executor after the current batch; completes everything still queued with
  // UNAVAILABLE. Idempotent.
  void Stop();

 private:
  struct Item {
    std::shared_ptr<WorkRequest> r;
    int t0, t1;  // token range (a chunk or the whole request)
  };
  struct LayerQueue {
    std::deque<Item> small, chunks;
    int small_tokens = 0;
  };
  void Loop();
  // Picks the next batch under mu_; empty when nothing is due yet (then *wake is when to look again).
  std::vector<Item> NextBatch(Clock::time_point now, Clock::time_point* wake);
  void ExpireLocked(Clock::time_point now, std::vector<Item>* expired);
  void RunBatch(std::vector<Item>& batch);
  void Finish(const std::shared_ptr<WorkRequest>& r, absl::Status s);

  const SchedulerOptions opt_;
  MoeBackend* backend_;
  WorkerMetrics* metrics_;
  const int hidden_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<int, LayerQueue> queues_;
  int waiting_requests_ = 0;  // requests with no chunk started
  int in_flight_ = 0;
  int batches_since_chunk_ = 0;
  bool stopping_ = false;
  std::thread thread_;

  // Executor scratch, reused across batches.
  std::vector<float> x_, out_, w_;
  std::vector<int32_t> ids_;
};

}  // namespace exl3::worker
