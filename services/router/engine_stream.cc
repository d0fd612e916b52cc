#include "services/router/engine_stream.h"

#include <utility>

#include "services/common/status.h"

namespace exl3::router {

namespace {
svc::BidiStreamOptions EngineStreamOptions() {
  svc::BidiStreamOptions o;
  o.pause_reads_at = EngineStream::kMaxQueued;
  o.name = "engine stream";
  return o;
}
}  // namespace

EngineStream::EngineStream(EngineStreamService* svc) : BidiStream(mu, EngineStreamOptions()), svc_(svc) {}

void EngineStream::Answer(pb::MoeLayerResponse r, bool erase_id) {
  std::lock_guard<std::mutex> l(mu);
  if (erase_id) inflight.erase(r.id());
  if (const size_t n = r.ByteSizeLong(); n > svc_->max_message_bytes()) {
    pb::MoeLayerResponse e;
    e.set_id(r.id());
    e.set_layer(r.layer());
    svc::SetRequestStatus(svc_->AnswerTooLarge(n), e.mutable_status());
    r = std::move(e);
  }
  WriteLocked(std::move(r), svc::Path::kStream);
}

void EngineStream::BeginHandling() {
  std::lock_guard<std::mutex> l(mu);
  ++handling_;
}

void EngineStream::EndHandling() {
  std::lock_guard<std::mutex> l(mu);
  --handling_;
  MaybeFinishLocked();
}

void EngineStream::OnMessage(pb::MoeLayerRequest& req, svc::Path) {
  svc_->OnStreamRequest(shared_from_this(), req);
}

bool EngineStream::OwesAnswersLocked() const { return handling_ > 0 || !inflight.empty(); }

void EngineStream::OnAbandoned() { svc_->CancelStream(*this); }

void EngineStream::OnEnded(const grpc::Status&) {
  svc_->StreamEnded(this);  // may drop the last reference: nothing after this
}

}  // namespace exl3::router
