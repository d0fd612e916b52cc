#include "services/expert_worker/scheduler.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/scratch.h"
#include "base/logging.h"
#include "services/common/status.h"

namespace exl3::worker {

Scheduler::Scheduler(const SchedulerOptions& opt, MoeBackend* backend, WorkerMetrics* metrics,
                     int hidden)
    : opt_(opt),
      backend_(backend),
      metrics_(metrics),
      hidden_(hidden),
      inline_ok_(backend != nullptr && backend->forward_on_any_thread()) {}

void Scheduler::Start() {
  if (backend_ != nullptr) staging_ = backend_->staging();
  thread_ = std::thread([this] { Loop(); });
}

Scheduler::~Scheduler() { Stop(); }

int Scheduler::InFlight() const {
  std::lock_guard<std::mutex> l(mu_);
  return in_flight_;
}

absl::Status Scheduler::Submit(std::shared_ptr<WorkRequest> r) {
  const int long_tokens = std::max(1, std::min(opt_.long_prefill_tokens, opt_.max_batch_tokens));
  // Outside mu_: a large request's output buffer is no reason to hold the executor off.
  r->out_bytes.resize(static_cast<size_t>(r->tokens) * hidden_ * sizeof(float));
  {
    std::unique_lock<std::mutex> l(mu_);
    if (stopping_) return absl::UnavailableError("worker is shutting down");
    if (!lost_.ok()) {
      return absl::UnavailableError(absl::StrCat("the worker's ", backend_->name(),
                                                 " backend failed and cannot compute: ",
                                                 std::string(lost_.message())));
    }
    if (waiting_requests_ >= opt_.max_queue) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "worker queue is full (", waiting_requests_, " requests waiting, --max-queue ",
          opt_.max_queue, "); retry later or on another replica"));
    }
    const Clock::time_point now = Clock::now();
    if (inline_ok_ && !running_ && waiting_requests_ == 0 && r->tokens <= opt_.inline_max_tokens &&
        r->tokens <= long_tokens && opt_.batch_window.count() == 0 && r->deadline > now &&
        !r->cancel_requested.load() && !(r->sink && r->sink->Cancelled())) {
      // Nothing to batch with and the backend is idle: compute here, no executor hand-off.
      // running_ keeps the executor (and other submitters) off the backend meanwhile.
      running_ = true;
      r->started = true;
      r->start_time = now;
      ++in_flight_;
      l.unlock();
      std::vector<Item> batch{{r, 0, r->tokens}};
      RunBatch(batch);
      l.lock();
      running_ = false;
      const bool more = waiting_requests_ > 0 || stopping_;
      l.unlock();
      if (more) cv_.notify_all();  // the executor waited for the backend
      return absl::OkStatus();
    }
    LayerQueue& q = queues_[{r->layer, r->shared}];
    if (r->tokens > long_tokens) {
      q.chunks.push_back({r, 0, r->tokens});
    } else {
      q.small.push_back({r, 0, r->tokens});
      q.small_tokens += r->tokens;
    }
    ++waiting_requests_;
    ++in_flight_;
    if (metrics_) metrics_->queue_depth().Set(waiting_requests_);
  }
  cv_.notify_one();
  return absl::OkStatus();
}

void Scheduler::Wake() {
  // Taking the lock orders this wake after the executor's last look at the queues: it is either
  // before that look (and sees the flag) or already waiting (and is woken).
  { std::lock_guard<std::mutex> l(mu_); }
  cv_.notify_all();
}

void Scheduler::Stop() {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  // Whatever is still queued is answered, never dropped.
  std::vector<std::shared_ptr<WorkRequest>> left;
  {
    std::lock_guard<std::mutex> l(mu_);
    for (auto& [layer, q] : queues_) {
      for (auto* dq : {&q.small, &q.chunks}) {
        for (Item& it : *dq) {
          if (!it.r->failed) {
            it.r->failed = true;
            left.push_back(it.r);
          }
        }
        dq->clear();
      }
      q.small_tokens = 0;
    }
    waiting_requests_ = 0;
  }
  for (auto& r : left) Finish(r, absl::UnavailableError("worker stopped before computing this request"));
}

void Scheduler::ExpireLocked(Clock::time_point now, std::vector<Item>* expired) {
  for (auto& [layer, q] : queues_) {
    for (auto* dq : {&q.small, &q.chunks}) {
      auto keep = dq->begin();
      for (auto it = dq->begin(); it != dq->end(); ++it) {
        WorkRequest& r = *it->r;
        const bool drop = r.failed || r.deadline <= now || (r.sink && r.sink->Cancelled()) ||
                          r.cancel_requested.load();
        if (!drop) {
          if (keep != it) *keep = std::move(*it);
          ++keep;
          continue;
        }
        if (dq == &q.small) q.small_tokens -= it->t1 - it->t0;
        if (!r.failed) {
          r.failed = true;
          if (!r.started) --waiting_requests_;
          expired->push_back(std::move(*it));
        }
      }
      dq->erase(keep, dq->end());
    }
  }
}

int Scheduler::ChunkTokens(Clock::time_point now) const {
  const int cap = std::max(1, std::min(opt_.long_prefill_tokens, opt_.max_batch_tokens));
  const bool decode_active = now - last_small_batch_ < std::chrono::milliseconds(100);
  if (!decode_active) return cap;
  return std::clamp(static_cast<int>(chunk_tokens_), 1, cap);
}

std::vector<Scheduler::Item> Scheduler::NextBatch(Clock::time_point now, Clock::time_point* wake) {
  *wake = Clock::time_point::max();
  LayerQueue* small_q = nullptr;
  LayerQueue* chunk_q = nullptr;
  for (auto& [layer, q] : queues_) {
    for (auto* dq : {&q.small, &q.chunks}) {
      for (const Item& it : *dq) {
        if (it.r->deadline < *wake) *wake = it.r->deadline;
      }
    }
    if (!q.small.empty() &&
        (small_q == nullptr || q.small.front().r->received < small_q->small.front().r->received)) {
      small_q = &q;
    }
    if (!q.chunks.empty() &&
        (chunk_q == nullptr || q.chunks.front().r->received < chunk_q->chunks.front().r->received)) {
      chunk_q = &q;
    }
  }
  std::vector<Item> batch;
  int tokens = 0;
  auto take_small = [&](LayerQueue& q) {
    while (!q.small.empty()) {
      const int n = q.small.front().t1 - q.small.front().t0;
      if (!batch.empty() && tokens + n > opt_.max_batch_tokens) break;
      tokens += n;
      q.small_tokens -= n;
      batch.push_back(std::move(q.small.front()));
      q.small.pop_front();
    }
  };
  const bool chunk_turn = chunk_q != nullptr && (small_q == nullptr || batches_since_chunk_ >= opt_.chunk_every);
  if (!chunk_turn && small_q != nullptr) {
    const Clock::time_point due = small_q->small.front().r->received + opt_.batch_window;
    if (small_q->small_tokens < opt_.max_batch_tokens && now < due && !stopping_) {
      *wake = std::min(*wake, due);
      return batch;
    }
    take_small(*small_q);
    batches_since_chunk_ = chunk_q != nullptr ? batches_since_chunk_ + 1 : 0;
  } else if (chunk_q != nullptr) {
    Item& front = chunk_q->chunks.front();
    const int n = std::min(front.t1 - front.t0, ChunkTokens(now));
    batch.push_back({front.r, front.t0, front.t0 + n});
    tokens += n;
    front.t0 += n;
    if (front.t0 >= front.t1) chunk_q->chunks.pop_front();
    // Small requests of the same layer ride along when there is room.
    take_small(*chunk_q);
    batches_since_chunk_ = 0;
  }
  for (Item& it : batch) {
    if (!it.r->started) {
      it.r->started = true;
      it.r->start_time = now;
      --waiting_requests_;
    }
  }
  if (metrics_) metrics_->queue_depth().Set(waiting_requests_);
  return batch;
}

void Scheduler::Loop() {
  std::unique_lock<std::mutex> l(mu_);
  while (true) {
    const Clock::time_point now = Clock::now();
    std::vector<Item> expired;
    ExpireLocked(now, &expired);
    Clock::time_point wake = Clock::time_point::max();
    // While an inline batch computes the backend is busy: its submitter notifies when done.
    std::vector<Item> batch;
    if (running_) {
      wake = Clock::time_point::max();
    } else if (!stopping_) {
      batch = NextBatch(now, &wake);
      // The backend is this thread's from now on: mu_ is released below to answer the expired
      // requests, and an inline Submit meanwhile must not start a second batch on the backend.
      if (!batch.empty()) running_ = true;
    }
    if (!expired.empty()) {
      if (metrics_) metrics_->queue_depth().Set(waiting_requests_);
      l.unlock();
      for (Item& it : expired) {
        const bool cancelled = it.r->sink && it.r->sink->Cancelled();
        if (!cancelled && it.r->cancel_requested.load()) {
          Finish(it.r, absl::CancelledError(absl::StrCat(
                           "request ", it.r->id, " cancelled by the caller (",
                           svc::CancelReasonName(it.r->cancel_reason.load()), ") before ",
                           it.r->started ? "its last chunk" : "it was computed")));
          continue;
        }
        Finish(it.r, cancelled ? absl::CancelledError("stream cancelled")
                               : absl::DeadlineExceededError(absl::StrCat(
                                     "deadline exceeded before request ", it.r->id,
                                     " was computed (queued for ",
                                     std::chrono::duration_cast<std::chrono::microseconds>(
                                         now - it.r->received).count(),
                                     " us)")));
      }
      l.lock();
    }
    if (!batch.empty()) {
      // Taken from the queues, so computed and answered even when Stop came meanwhile (Stop
      // answers only what is still queued).
      l.unlock();
      RunBatch(batch);
      l.lock();
      running_ = false;
      continue;
    }
    if (stopping_) {
      // An inline batch may still be computing on a submitter's thread: Stop returns after it.
      cv_.wait(l, [&] { return !running_; });
      return;
    }
    if (!expired.empty()) continue;  // state changed: look again
    if (wake == Clock::time_point::max()) {
      cv_.wait(l);
    } else {
      cv_.wait_until(l, wake);
    }
  }
}

void Scheduler::RunBatch(std::vector<Item>& batch) {
  const int H = hidden_;
  int T = 0, S = 1;
  for (const Item& it : batch) {
    T += it.t1 - it.t0;
    S = std::max(S, it.r->slots);
  }
  BatchView b;
  b.layer = batch.front().r->layer;
  b.shared = batch.front().r->shared;  // the same for the whole batch (queued apart)
  b.tokens = T;
  const bool single = batch.size() == 1;
  if (single) {
    // No gather/scatter: the request's own buffers, offset to the chunk.
    const Item& it = batch.front();
    const WorkRequest& r = *it.r;
    b.slots = r.slots;
    b.x = r.x + static_cast<size_t>(it.t0) * H;
    b.ids = r.ids.data() + static_cast<size_t>(it.t0) * r.slots;
    b.weights = r.weights.data() + static_cast<size_t>(it.t0) * r.slots;
    b.out = it.r->out() + static_cast<size_t>(it.t0) * H;
  } else {
    // Gathered into the backend's own staging where it has one (one host copy less each way).
    const bool staged = T <= staging_.max_tokens;
    if (!staged) {
      x_.resize(static_cast<size_t>(T) * H);
      out_.resize(static_cast<size_t>(T) * H);
    }
    float* x = staged ? staging_.x : x_.data();
    ids_.assign(static_cast<size_t>(T) * S, -1);
    w_.assign(static_cast<size_t>(T) * S, 0.0f);
    int row = 0;
    for (const Item& it : batch) {
      const WorkRequest& r = *it.r;
      const int n = it.t1 - it.t0;
      std::copy_n(r.x + static_cast<size_t>(it.t0) * H, static_cast<size_t>(n) * H,
                  x + static_cast<size_t>(row) * H);
      for (int t = 0; t < n; ++t) {
        for (int s = 0; s < r.slots; ++s) {
          const size_t src = static_cast<size_t>(it.t0 + t) * r.slots + s;
          const size_t dst = static_cast<size_t>(row + t) * S + s;
          ids_[dst] = r.ids[src];
          w_[dst] = r.weights[src];
        }
      }
      row += n;
    }
    b.slots = S;
    b.x = x;
    b.ids = ids_.data();
    b.weights = w_.data();
    b.out = staged ? staging_.out : out_.data();
  }
  const auto t0 = Clock::now();
  const absl::Status st = backend_->Forward(b);
  const int64_t dt = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
  if (!st.ok()) {
    absl::Status health = backend_->Health();
    bool first = false;
    if (!health.ok()) {
      std::lock_guard<std::mutex> l(mu_);
      first = lost_.ok();
      if (first) lost_ = health;
    }
    if (first && opt_.on_backend_lost) opt_.on_backend_lost(health);
  }
  // Chunk sizing feedback: small batches set the time budget, chunk batches are scaled to it.
  {
    const double us = dt / 1000.0;
    int chunk_tokens = 0;
    for (const Item& it : batch) {
      if (it.r->tokens > std::min(opt_.long_prefill_tokens, opt_.max_batch_tokens)) chunk_tokens += it.t1 - it.t0;
    }
    if (chunk_tokens == 0) {
      small_batch_us_ = small_batch_us_ == 0 ? us : 0.8 * small_batch_us_ + 0.2 * us;
      last_small_batch_ = Clock::now();
    } else if (us > 0) {
      const double budget = opt_.prefill_chunk_us > 0 ? opt_.prefill_chunk_us
                                                      : std::max(100.0, small_batch_us_);
      const double cap = std::max(1, std::min(opt_.long_prefill_tokens, opt_.max_batch_tokens));
      const double want = std::clamp(chunk_tokens * budget / us, 1.0, cap);
      // Geometric smoothing: converges to the size whose compute takes about the budget.
      chunk_tokens_ = std::clamp(std::sqrt(std::min(chunk_tokens_, cap) * want), 1.0, cap);
    }
  }
  if (metrics_) {
    if (WorkerMetrics::Layer* m = metrics_->layer(b.layer)) {
      m->batch_tokens->Observe(T);
      m->batch_requests->Observe(static_cast<double>(batch.size()));
    }
  }
  int row = 0;
  for (Item& it : batch) {
    WorkRequest& r = *it.r;
    const int n = it.t1 - it.t0;
    if (!single && st.ok()) {
      std::copy_n(b.out + static_cast<size_t>(row) * H, static_cast<size_t>(n) * H,
                  r.out() + static_cast<size_t>(it.t0) * H);
    }
    row += n;
    r.compute_ns += dt;
    r.tokens_done += n;
    ++r.chunks;
    r.batch_tokens = T;
    r.batch_requests = static_cast<int>(batch.size());
    if (r.failed) continue;  // answered already (a previous chunk's batch failed)
    if (!st.ok()) {
      r.failed = true;  // its other queued chunks are dropped by ExpireLocked
      Finish(it.r, absl::InternalError(absl::StrCat("backend ", backend_->name(), " failed: ",
                                                    std::string(st.message()))));
      continue;
    }
    if (r.tokens_done == r.tokens) Finish(it.r, absl::OkStatus());
  }
  // A batch of --max-batch-tokens at a large hidden size grows these to 100+ MB each.
  ReleaseScratchIfLarge(x_);
  ReleaseScratchIfLarge(out_);
  ReleaseScratchIfLarge(w_);
  ReleaseScratchIfLarge(ids_);
}

void Scheduler::Finish(const std::shared_ptr<WorkRequest>& r, absl::Status s) {
  if (r->sink) r->sink->Complete(r, std::move(s));
  std::lock_guard<std::mutex> l(mu_);
  --in_flight_;
}

}  // namespace exl3::worker
