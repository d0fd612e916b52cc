#include "services/expert_worker/worker_stream.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "services/common/shm_channel.h"
#include "services/common/status.h"
#include "services/common/wire.h"

namespace exl3::worker {

namespace {

int64_t Micros(Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::microseconds>(d).count();
}
double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

svc::BidiStreamOptions WorkerStreamOptions() {
  svc::BidiStreamOptions o;
  o.pause_reads_at = WorkerStream::kMaxBacklog;
  o.name = "worker stream";
  return o;
}

// The answer's timings.
void FillTimings(const WorkRequest& r, Clock::time_point now, pb::WorkerTimings* tm) {
  tm->set_total_us(Micros(now - r.received));
  tm->set_chunks(r.chunks);
  if (r.started) tm->set_queue_us(Micros(r.start_time - r.received));
  tm->set_compute_us(r.compute_ns / 1000);
  tm->set_batch_tokens(r.batch_tokens);
  tm->set_batch_requests(r.batch_requests);
}

// The partial sum [T, H], moved out of `r`.
void FillOutput(WorkRequest& r, pb::Tensor* out) {
  const int H = static_cast<int>(r.out_bytes.size() / sizeof(float) / std::max(1, r.tokens));
  if (r.output_dtype == pb::DTYPE_FP32) {
    out->set_dtype(pb::DTYPE_FP32);
    out->add_shape(r.tokens);
    out->add_shape(H);
    out->set_data(std::move(r.out_bytes));
  } else {
    svc::EncodeTensor(r.out(), {r.tokens, H}, r.output_dtype, out);
  }
}

}  // namespace

WorkerStream::WorkerStream(WorkerStreamService* w, grpc::CallbackServerContext* ctx)
    : BidiStream(WorkerStreamOptions()), w_(w), ctx_(ctx) {}

void WorkerStream::Start() {
  w_->Register(shared_from_this());
  const auto dl = ctx_->deadline();
  if (dl != std::chrono::system_clock::time_point::max() &&
      dl < std::chrono::system_clock::now() + std::chrono::hours(24 * 365)) {
    stream_deadline_ = Clock::now() + (dl - std::chrono::system_clock::now());
  }
  Begin();
}

void WorkerStream::Complete(std::shared_ptr<WorkRequest> r, absl::Status status) {
  const Clock::time_point now = Clock::now();
  pb::ExpertResponse resp;
  resp.set_id(r->id);
  resp.set_layer(r->layer);
  svc::SetRequestStatus(status, resp.mutable_status());
  FillTimings(*r, now, resp.mutable_timings());
  RecordMetrics(*r, status, now);
  if (status.ok()) FillOutput(*r, resp.mutable_output());
  // Completed: nothing computes from its hidden states any more
  // (services/expert_worker/scheduler.h).
  // Read from the side channel, their buffer is the next side-channel request's.
  std::string hidden;
  {
    std::lock_guard<std::mutex> l(mutex());
    auto it = ids_.find(r->id);
    if (it != ids_.end() && it->second.path == svc::Path::kSideChannel &&
        r->x_bytes.capacity() <= kMaxSpareBytes) {
      hidden = std::move(r->x_bytes);
      r->x = nullptr;
    }
  }
  Send(std::move(resp), /*release_id=*/true, svc::Path::kStream);
  if (hidden.capacity() > 0) {
    std::lock_guard<std::mutex> l(mutex());
    spare_hidden_ = std::move(hidden);
  }
}

std::string WorkerStream::TakeSpareOutput() {
  std::string out;
  {
    std::lock_guard<std::mutex> l(mutex());
    out = std::move(spare_output_);
  }
  // Its old bytes stay: Submit's resize then writes only what the request needs beyond them (a
  // zero-fill of T * hidden floats per call otherwise), and every backend overwrites the whole
  // output (BatchView::out).
  return out;
}

void WorkerStream::SideWrittenLocked(pb::ExpertResponse& m) {
  if (!m.has_output()) return;
  std::string* data = m.mutable_output()->mutable_data();
  if (data->capacity() <= kMaxSpareBytes) spare_output_ = std::move(*data);
}

void WorkerStream::BeforeSideRead(pb::ExpertRequest& m) {
  std::string hidden;
  {
    std::lock_guard<std::mutex> l(mutex());
    hidden = std::move(spare_hidden_);
  }
  if (hidden.capacity() > 0) m.mutable_hidden()->mutable_data()->swap(hidden);
}

void WorkerStream::RecordMetrics(const WorkRequest& r, const absl::Status& status,
                                 Clock::time_point now) {
  WorkerMetrics* m = w_->metrics();
  if (m == nullptr) return;
  if (r.cancel_requested.load()) {
    m->CountCancel(r.cancel_reason.load(),
                   status.code() == absl::StatusCode::kCancelled ? "dropped" : "completed");
  }
  if (!status.ok()) return m->CountError(status.code());
  if (WorkerMetrics::Layer* lm = m->layer(r.layer)) {
    lm->queue->Observe(Seconds(r.start_time - r.received));
    lm->compute->Observe(r.compute_ns * 1e-9);
    lm->total->Observe(Seconds(now - r.received));
    lm->requests->Increment();
    lm->tokens->Increment(r.tokens);
  }
  for (const auto& [e, n] : r.expert_tokens) m->CountExpertTokens(e, n);
}

void WorkerStream::SendError(uint64_t id, int layer, const absl::Status& s,
                             Clock::time_point received, svc::Path path) {
  pb::ExpertResponse resp;
  resp.set_id(id);
  resp.set_layer(layer);
  svc::SetRequestStatus(s, resp.mutable_status());
  resp.mutable_timings()->set_total_us(Micros(Clock::now() - received));
  if (WorkerMetrics* m = w_->metrics()) m->CountError(s.code());
  Send(std::move(resp), /*release_id=*/false, path);
}

void WorkerStream::Send(pb::ExpertResponse resp, bool release_id, svc::Path path) {
  std::lock_guard<std::mutex> l(mutex());
  if (release_id) {
    auto it = ids_.find(resp.id());
    if (it != ids_.end()) {
      path = it->second.path;
      ids_.erase(it);
    }
  }
  WriteLocked(std::move(resp), path);
}

void WorkerStream::OnMessage(pb::ExpertRequest& m, svc::Path from) {
  const Clock::time_point received = Clock::now();
  if (m.has_shm_offer()) {
    if (from == svc::Path::kStream) AttachShm(m.id(), m.shm_offer());
    return;  // an offer is only valid on the stream
  }
  if (m.has_cancel()) {
    // A control message, not a request: never answered itself.
    return HandleCancel(m.id(), m.cancel().reason());
  }
  HandleRequest(std::move(m), received, from);
}

void WorkerStream::HandleRequest(pb::ExpertRequest&& msg, Clock::time_point received,
                                 svc::Path from) {
  const uint64_t id = msg.id();
  const int layer = msg.layer();
  bool duplicate;
  {
    std::lock_guard<std::mutex> l(mutex());
    duplicate = !ids_.emplace(id, InFlight{{}, from}).second;
  }
  if (duplicate) {
    return SendError(id, layer,
                     absl::InvalidArgumentError(absl::StrCat(
                         "duplicate in-flight id ", id,
                         " on this stream (the first one is still being computed)")),
                     received, from);
  }
  std::shared_ptr<WorkRequest> accepted;
  absl::Status s = w_->Accept(std::move(msg), shared_from_this(), received, stream_deadline_, &accepted);
  std::unique_lock<std::mutex> l(mutex());
  if (!s.ok()) {
    ids_.erase(id);  // its answer, queued next, keeps the stream from finishing
    l.unlock();
    return SendError(id, layer, s, received, from);
  }
  // Only while still in flight: it may have been answered already (an id is only taken again
  // after its answer, by a later message).
  auto it = ids_.find(id);
  if (it != ids_.end()) it->second.r = accepted;
}

void WorkerStream::HandleCancel(uint64_t id, int reason) {
  std::shared_ptr<WorkRequest> r;
  {
    std::lock_guard<std::mutex> l(mutex());
    auto it = ids_.find(id);
    if (it != ids_.end()) r = it->second.r.lock();
  }
  if (r == nullptr) {
    // Already answered (or never sent): nothing to do, nothing to answer.
    if (WorkerMetrics* m = w_->metrics()) m->CountCancel(reason, "late");
    return;
  }
  w_->Cancel(r, reason);
}

void WorkerStream::AttachShm(uint64_t id, const pb::SharedMemoryOffer& offer) {
  const absl::Status st = TryAttachShm(offer);
  if (!st.ok()) exl3::LogInfo("shared-memory offer declined: %s", std::string(st.message()).c_str());
  pb::ExpertResponse resp;
  resp.set_id(id);
  svc::SetRequestStatus(st, resp.mutable_status());
  resp.set_shm_attached(st.ok());
  Send(std::move(resp), /*release_id=*/false, svc::Path::kStream);
}

absl::Status WorkerStream::TryAttachShm(const pb::SharedMemoryOffer& offer) {
  if (!w_->shm_enabled()) {
    return absl::FailedPreconditionError("shared memory is off on this worker (--shm=false)");
  }
  {
    std::lock_guard<std::mutex> l(mutex());
    if (HasSideChannelLocked()) {
      return absl::FailedPreconditionError("this stream already has a shared-memory channel");
    }
  }
  absl::StatusOr<std::unique_ptr<svc::ShmChannel>> ch =
      svc::ShmChannel::Attach(offer.name(), offer.nonce(), w_->shm_spin_us());
  if (!ch.ok()) return ch.status();
  (*ch)->Unlink();  // mapped: the name is no longer needed (nothing leaks if the router dies)
  std::lock_guard<std::mutex> l(mutex());
  if (!AttachSideChannelLocked(std::move(*ch))) return absl::CancelledError("stream ending");
  return absl::OkStatus();
}

void WorkerStream::OnEnded(const grpc::Status&) {
  std::shared_ptr<WorkerStream> keep = shared_from_this();
  w_->Unregister(this);
}

}  // namespace exl3::worker
