// The worker's batcher: requests of every stream for the same layer are batched together and run
// on the backend one batch at a time. Batching is work-conserving by default: a batch starts as
// soon as the backend is free, and the requests that arrive while it computes form the next one
// (so batches grow with load and a lone request never waits). `batch_window` > 0 (opt-in) makes a
// batch wait up to that long for company. At most `max_batch_tokens` tokens per batch.
//
// Batches run on one executor thread, except that a request of at most `inline_max_tokens` tokens
// that finds the backend idle and nothing queued runs at once on the thread that submitted it
// (when the backend allows Forward from any thread): no hand-off to the executor at low load.
//
// Long prefills never starve decode: a request with more than `long_prefill_tokens` tokens is
// queued apart from the small ones and computed in chunks that alternate with the small
// (decode) batches (one chunk per `chunk_every` small batches while small requests wait). While
// decode traffic is present (a small batch ran in the last 100 ms) each chunk is sized to take
// about `prefill_chunk_us` of compute (0: as long as a recent small batch took, at least 100 µs),
// so a decode request waits at most about one small batch's time behind a prefill; with no decode
// traffic chunks grow to `long_prefill_tokens` for throughput. Deadlines are checked while queued
// and before each batch; requests of cancelled streams, and requests their caller cancelled
// (WorkRequest::cancel_requested, then Wake), are dropped before their next batch (completed as
// CANCELLED) without disturbing the other requests they would have been batched with.
// Shared-expert requests are batched apart from routed-only ones (one batch = one layer, with or
// without the shared expert for all its tokens).
//
//   Scheduler sched(opts, backend, metrics, hidden_size);
//   sched.Start();
//   absl::Status s = sched.Submit(request);   // RESOURCE_EXHAUSTED when max_queue requests wait
//   ... every submitted request's sink->Complete is called exactly once ...
//   sched.Stop();                              // completes what is still queued as UNAVAILABLE
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
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
  std::chrono::microseconds batch_window{0};  // 0: work-conserving (see the class comment)
  int inline_max_tokens = 64;  // run a lone request this small on the submitting thread (0: never)
  int max_batch_tokens = 4096;
  int long_prefill_tokens = 1024;  // requests above this are chunked (chunks at most this size)
  int max_queue = 1024;            // requests waiting (not yet started) at most
  int chunk_every = 1;             // with small requests waiting, 1 chunk batch per this many batches
  int prefill_chunk_us = 0;        // compute time per chunk under decode load; 0: auto
  // Called once (from the thread that ran the batch) when a failed batch left the backend
  // unusable (MoeBackend::Health); afterwards Submit fails with UNAVAILABLE.
  std::function<void(const absl::Status&)> on_backend_lost;
};

class Scheduler {
 public:
  Scheduler(const SchedulerOptions& opt, MoeBackend* backend, WorkerMetrics* metrics, int hidden);
  ~Scheduler();

  void Start();
  // Queues `r` (validated). Fails with RESOURCE_EXHAUSTED when max_queue requests already wait,
  // UNAVAILABLE after Stop. On failure the caller answers the request itself. May compute `r` (and
  // complete it through its sink) before returning: see inline_max_tokens.
  absl::Status Submit(std::shared_ptr<WorkRequest> r);
  // Requests submitted and not yet completed.
  int InFlight() const;
  // Makes the executor look at its queues now (after a request's cancel_requested was set).
  void Wake();
  // Stops the executor after the current batch; completes everything still queued with
  // UNAVAILABLE. Idempotent.
  void Stop();

 private:
  struct Item {
    std::shared_ptr<WorkRequest> r;
    int t0, t1;  // token range (a chunk or the whole request)
  };
  struct LayerQueue {
    std::deque<Item> small;
    std::deque<Item> chunks;  // long requests: [t0, t1) is what is left to compute
    int small_tokens = 0;
  };
  // Tokens for the next chunk (see the class comment).
  int ChunkTokens(Clock::time_point now) const;
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
  std::map<std::pair<int, bool>, LayerQueue> queues_;  // by (layer, shared expert)
  int waiting_requests_ = 0;  // requests with no chunk started
  int in_flight_ = 0;
  int batches_since_chunk_ = 0;
  // Chunk sizing (executor thread): recent small-batch compute and the current chunk size.
  double small_batch_us_ = 0;
  double chunk_tokens_ = 64;
  Clock::time_point last_small_batch_{};
  bool stopping_ = false;
  absl::Status lost_;  // guarded by mu_: not OK once the backend is unusable
  bool running_ = false;  // a batch is computing (executor or an inline submitter)
  const bool inline_ok_;   // the backend allows Forward from any thread
  std::thread thread_;

  // Executor scratch, reused across batches: a batch of several requests is gathered into the
  // backend's staging (MoeBackend::staging) when it has one that fits, else into x_ / out_.
  MoeBackend::Staging staging_;
  std::vector<float> x_, out_, w_;
  std::vector<int32_t> ids_;
};

}  // namespace exl3::worker
