#include "services/router/in_process_router.h"

#include <condition_variable>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace exl3::router {

// The answers of one InProcessStream: each goes to its request's callback.
class InProcessSink : public AnswerSink {
 public:
  void Answer(pb::MoeLayerResponse r, bool erase_id) override {
    if (erase_id) {
      std::lock_guard<std::mutex> l(mu);
      inflight.erase(r.id());
    }
    client::ResponseCallback cb = Take(r.id());
    if (!cb) return;  // called back already (Cancel)
    cb(absl::OkStatus(), &r);
    Done();
  }
  void BeginHandling() override {
    std::lock_guard<std::mutex> l(cb_mu_);
    ++handling_;
  }
  void EndHandling() override {
    std::lock_guard<std::mutex> l(cb_mu_);
    --handling_;
    cb_cv_.notify_all();
  }

  // Registers `cb` under a fresh id; 0 when the stream is closed.
  uint64_t Add(client::ResponseCallback cb) {
    std::lock_guard<std::mutex> l(cb_mu_);
    if (closed_) return 0;
    const uint64_t id = next_id_++;
    pending_[id] = std::move(cb);
    return id;
  }
  // Removes and returns the callback of `id` (empty when there is none); a non-empty one must be
  // followed by Done() once it has run.
  client::ResponseCallback Take(uint64_t id) {
    std::lock_guard<std::mutex> l(cb_mu_);
    auto it = pending_.find(id);
    if (it == pending_.end()) return nullptr;
    client::ResponseCallback cb = std::move(it->second);
    pending_.erase(it);
    ++running_;
    return cb;
  }
  void Done() {
    std::lock_guard<std::mutex> l(cb_mu_);
    --running_;
    cb_cv_.notify_all();
  }
  void CloseAndWait() {
    std::unique_lock<std::mutex> l(cb_mu_);
    closed_ = true;
    cb_cv_.wait(l, [&] { return pending_.empty() && running_ == 0 && handling_ == 0; });
  }
  // After the service cancelled the stream: once no request is left on the handler pool, the
  // callbacks not answered (requests that never got in flight) run with CANCELLED.
  void FailPending() {
    std::vector<client::ResponseCallback> left;
    {
      std::unique_lock<std::mutex> l(cb_mu_);
      closed_ = true;
      cb_cv_.wait(l, [&] { return handling_ == 0; });
      for (auto& [id, cb] : pending_) left.push_back(std::move(cb));
      pending_.clear();
      running_ += static_cast<int>(left.size());
    }
    for (auto& cb : left) {
      cb(absl::CancelledError("the stream was cancelled"), nullptr);
      Done();
    }
  }
  int outstanding() const {
    std::lock_guard<std::mutex> l(cb_mu_);
    return static_cast<int>(pending_.size());
  }

 private:
  mutable std::mutex cb_mu_;
  std::condition_variable cb_cv_;
  std::unordered_map<uint64_t, client::ResponseCallback> pending_;  // guarded by cb_mu_
  uint64_t next_id_ = 1;                                             // guarded by cb_mu_
  int running_ = 0;   // guarded by cb_mu_: callbacks taken and not yet returned
  int handling_ = 0;  // guarded by cb_mu_: requests on the service's handler pool
  bool closed_ = false;
};

InProcessStream::InProcessStream(MoeRouterService& svc, int inline_max_tokens)
    : svc_(svc), inline_max_tokens_(inline_max_tokens), sink_(std::make_shared<InProcessSink>()) {}

InProcessStream::~InProcessStream() { (void)Close(); }

std::unique_ptr<InProcessStream> InProcessStream::Open(MoeRouterService& svc, int inline_max_tokens) {
  return std::unique_ptr<InProcessStream>(new InProcessStream(svc, inline_max_tokens));
}

absl::Status InProcessStream::Send(pb::MoeLayerRequest& req, client::ResponseCallback cb) {
  const uint64_t id = sink_->Add(std::move(cb));
  if (id == 0) return absl::UnavailableError("stream closed");
  req.set_id(id);
  // The service takes the hidden bytes out of the request it handles; the caller keeps `req`.
  pb::MoeLayerRequest copy = req;
  svc_.Submit(sink_, copy);
  return absl::OkStatus();
}

absl::Status InProcessStream::SendOwned(pb::MoeLayerRequest req, float* out,
                                        client::ResponseCallback cb) {
  const uint64_t id = sink_->Add(std::move(cb));
  if (id == 0) return absl::UnavailableError("stream closed");
  req.set_id(id);
  svc_.Submit(sink_, req, out);
  return absl::OkStatus();
}

absl::Status InProcessStream::CancelRequest(uint64_t id, pb::CancelReason reason) {
  pb::MoeLayerRequest c;
  c.set_id(id);
  c.mutable_cancel()->set_reason(reason);
  svc_.Submit(sink_, c);
  return absl::OkStatus();
}

void InProcessStream::Cancel() {
  svc_.CancelStream(*sink_);
  sink_->FailPending();
}

absl::Status InProcessStream::Close() {
  sink_->CloseAndWait();
  return sink_->cancelled ? absl::CancelledError("stream cancelled") : absl::OkStatus();
}

int InProcessStream::in_flight() const { return sink_->outstanding(); }

absl::StatusOr<std::unique_ptr<InProcessRouter>> InProcessRouter::Create(
    const InProcessRouterOptions& o) {
  std::unique_ptr<InProcessRouter> r(new InProcessRouter());
  auto ep = svc::MetricsEndpoint::Start("");
  if (!ep.ok()) return ep.status();
  r->metrics_ = std::move(*ep);
  auto core = RouterCore::Create(o.core, r->metrics_->registry());
  if (!core.ok()) return core.status();
  r->core_ = std::move(*core);
  r->inline_max_tokens_ = o.core.router.inline_max_tokens;
  if (o.ready_timeout.count() > 0 && !r->core_->WaitReady(o.ready_timeout)) {
    return absl::UnavailableError(absl::StrCat(
        "not ready after ", o.ready_timeout.count(), " ms: ",
        r->core_->service().pool()->UnservedExperts(), " experts have no serving worker (map ",
        o.core.expert_map_path, ")"));
  }
  return r;
}

InProcessRouter::~InProcessRouter() {
  if (core_) core_->Stop();
}

std::unique_ptr<InProcessStream> InProcessRouter::OpenStream() {
  return InProcessStream::Open(core_->service(), inline_max_tokens_);
}

}  // namespace exl3::router
