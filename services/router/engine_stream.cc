#include "services/router/engine_stream.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "services/common/logging.h"
#include "services/common/raw_message.h"
#include "services/common/status.h"
#include "services/router/moe_router.h"

namespace exl3::router {

void EngineStream::Begin() {
  std::lock_guard<std::mutex> l(mu);
  StartRead(&in_);
}

void EngineStream::Answer(pb::MoeLayerResponse r, bool erase_id) {
  std::lock_guard<std::mutex> l(mu);
  if (erase_id) inflight.erase(r.id());
  if (cancelled || broken_ || finished_) return MaybeFinishLocked();
  if (const size_t n = r.ByteSizeLong(); n > svc_->max_message_bytes()) {
    pb::MoeLayerResponse e;
    e.set_id(r.id());
    e.set_layer(r.layer());
    svc::SetRequestStatus(svc_->AnswerTooLarge(n), e.mutable_status());
    r = std::move(e);
  }
  out_.push_back(std::move(r));
  if (!writing_) {
    writing_ = true;
    WriteFrontLocked();
  }
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

void EngineStream::OnReadDone(bool ok) {
  if (!ok) {
    // Half-close (or the stream is gone): answer what is in flight, then end.
    std::lock_guard<std::mutex> l(mu);
    reads_done_ = true;
    return MaybeFinishLocked();
  }
  if (absl::Status st = svc::ParseRaw(&in_, &req_); !st.ok()) return EndUnparsable(st);
  svc_->Submit(shared_from_this(), req_);
  req_.Clear();
  std::lock_guard<std::mutex> l(mu);
  if (finished_) {
    reads_done_ = true;
  } else if (out_.size() >= kMaxQueued) {
    read_paused_ = true;  // resumed by OnWriteDone
  } else {
    StartRead(&in_);
  }
}

void EngineStream::EndUnparsable(const absl::Status& why) {
  // Not a request: the stream is unusable (its ids can no longer be trusted). Its requests in
  // flight end (their work withdrawn) and the stream ends with the reason.
  {
    std::lock_guard<std::mutex> l(mu);
    reads_done_ = true;
    end_status_ = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                               absl::StrCat(why.message(), "; the stream ends"));
  }
  svc_->CancelStream(*this);
  std::lock_guard<std::mutex> l(mu);
  MaybeFinishLocked();
}

void EngineStream::OnWriteDone(bool ok) {
  std::lock_guard<std::mutex> l(mu);
  out_.pop_front();
  if (!ok) {
    // The client is gone: later answers are dropped.
    broken_ = true;
    out_.clear();
    writing_ = false;
    return MaybeFinishLocked();
  }
  if (read_paused_ && !finished_ && out_.size() < kMaxQueued / 2) {
    read_paused_ = false;
    StartRead(&in_);
  }
  if (!out_.empty() && !finished_) return WriteFrontLocked();
  writing_ = false;
  MaybeFinishLocked();
}

void EngineStream::OnCancel() {
  // Nobody is left to answer (also after a half-close): end the requests in flight now, which
  // withdraws their work from the workers.
  svc_->CancelStream(*this);
  std::lock_guard<std::mutex> l(mu);
  MaybeFinishLocked();
}

void EngineStream::OnDone() {
  {
    std::lock_guard<std::mutex> l(mu);
    finished_ = true;
    out_.clear();
  }
  svc_->Unregister(this);  // may drop the last reference: nothing after this
}

void EngineStream::MaybeFinishLocked() {
  if (finished_ || writing_) return;
  if (cancelled || broken_) {
    finished_ = true;
    Finish(!end_status_.ok() ? end_status_
                             : grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled"));
    return;
  }
  if (!reads_done_ || handling_ > 0 || !inflight.empty() || !out_.empty()) return;
  finished_ = true;
  Finish(grpc::Status::OK);
}

void EngineStream::WriteFrontLocked() {
  absl::Status st = svc::SerializeRaw(out_.front(), &wbuf_);
  if (!st.ok()) svc::LogError("answer not sent: %s", std::string(st.message()).c_str());
  StartWrite(&wbuf_);
}

}  // namespace exl3::router
