#include "services/router/generate_stream.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "services/common/status.h"
#include "services/router/generate_messages.h"
#include "services/router/request_log.h"

namespace exl3::router {

namespace pb = ::exl3serve::v1;
using SteadyClock = std::chrono::steady_clock;

namespace {

double SecondsSince(SteadyClock::time_point t) {
  return std::chrono::duration<double>(SteadyClock::now() - t).count();
}

}  // namespace

// One GenerateStream call (services/router/generate_stream.h). Every member but the immutable
// ones is guarded by mu_.
class GenerateStreamReactor final
    : public grpc::ServerBidiReactor<pb::GenerateStreamRequest, pb::GenerateStreamResponse> {
 public:
  GenerateStreamReactor(GenerateStreams& registry, engine::Engine& engine,
                        grpc::CallbackServerContext* ctx)
      : registry_(registry), engine_(engine), call_deadline_(ctx->deadline()) {
    std::lock_guard<std::mutex> lock(mu_);
    StartRead(&in_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client half-closed, or the call ended
      std::lock_guard<std::mutex> lock(mu_);
      reads_ended_ = true;
      AdvanceLocked();
      return;
    }
    for (const pb::GenerateAction& a : in_.actions()) {
      switch (a.action_case()) {
        case pb::GenerateAction::kStart:
          StartRequest(a.stream_id(), a.start());
          break;
        case pb::GenerateAction::kCancel:
          CancelRequest(a.stream_id());
          break;
        case pb::GenerateAction::ACTION_NOT_SET: {
          std::lock_guard<std::mutex> lock(mu_);
          AbandonLocked(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                     "a GenerateAction needs start or cancel"));
          AdvanceLocked();
          break;
        }
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_) return;
    in_.Clear();
    StartRead(&in_);
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    for (SteadyClock::time_point t : firsts_in_flight_) {
      if (registry_.options_.first_write_done != nullptr) {
        registry_.options_.first_write_done->Observe(SecondsSince(t));
      }
    }
    firsts_in_flight_.clear();
    if (!ok) AbandonLocked(kClientGone);
    AdvanceLocked();
  }

  void OnCancel() override {
    std::lock_guard<std::mutex> lock(mu_);
    AbandonLocked(kClientGone);
    AdvanceLocked();
  }

  void OnDone() override {
    registry_.Remove(this);
    delete this;
  }

  // On the engine's loop thread (GenerateStreams::Flush).
  void Flush() {
    std::lock_guard<std::mutex> lock(mu_);
    AdvanceLocked();
  }

 private:
  // A request on the call, from its start message until its final event.
  struct Request {
    bool submitted = false;  // Engine::Submit has returned its id (engine_id)
    uint64_t engine_id = 0;
    bool cancel_wanted = false;  // cancelled before Submit returned
    bool tokens_seen = false;
  };

  // On one of gRPC's threads (OnReadDone).
  void StartRequest(uint64_t id, const pb::GenerateRequest& req) {
    const SteadyClock::time_point taken = SteadyClock::now();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (abandoned_) return;
      if (requests_.contains(id)) {
        // Its updates could not be told from the open request's: the client broke the call's
        // contract, so the call ends.
        AbandonLocked(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                   absl::StrCat("stream_id ", id, " is already open on this call")));
        AdvanceLocked();
        return;
      }
      requests_.emplace(id, Request{});
    }
    // Before Submit: its end may be logged before Submit returns.
    LogRequestStart(req.request_id(), req);
    const SteadyClock::time_point deadline =
        RequestDeadline(req, registry_.options_.default_timeout, call_deadline_);
    // Not under mu_: the engine may deliver the request's events (which take mu_) before Submit
    // returns; the entry made above receives them.
    // The constraint (if any) compiles here, on gRPC's thread, not on the engine's loop.
    absl::StatusOr<engine::GenerateParams> params =
        ToGenerateParams(req, deadline, registry_.options_);
    absl::StatusOr<uint64_t> engine_id =
        params.ok() ? engine_.Submit(*std::move(params),
                                     [this, id](const engine::GenerateEvent& e) { OnEvent(id, e); })
                    : params.status();
    std::lock_guard<std::mutex> lock(mu_);
    if (!engine_id.ok()) {
      LogRequestRefused(req.request_id(), req, engine_id.status(), taken);
      requests_.erase(id);
      if (!abandoned_) QueueRefusalLocked(id, svc::ToGrpcStatus(engine_id.status()));
      AdvanceLocked();
      return;
    }
    auto it = requests_.find(id);
    if (it == requests_.end()) return;  // its final event has come already
    it->second.submitted = true;
    it->second.engine_id = *engine_id;
    if (it->second.cancel_wanted) (void)engine_.Cancel(*engine_id);
  }

  void CancelRequest(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = requests_.find(id);
    if (it == requests_.end()) return;  // ended already, or never started: nothing to do
    CancelLocked(it->second);
  }

  void CancelLocked(Request& r) {
    if (r.submitted) {
      (void)engine_.Cancel(r.engine_id);
    } else {
      r.cancel_wanted = true;
    }
  }

  // On the engine's loop thread. Only gathers: Flush starts the write once the loop has
  // delivered the pass's events.
  void OnEvent(uint64_t id, const engine::GenerateEvent& e) {
    if (e.finish) LogRequestEnd(e.tag, *e.finish);
    std::lock_guard<std::mutex> lock(mu_);
    bool first = false;  // the event brings the request's first tokens
    if (auto it = requests_.find(id); it != requests_.end()) {
      if (!e.tokens.empty() && !it->second.tokens_seen) first = it->second.tokens_seen = true;
      if (e.finish) requests_.erase(it);
    }
    if (abandoned_) {
      // Nobody reads a call the client abandoned; its end waits for the final events only.
      if (e.finish) AdvanceLocked();
      return;
    }
    pb::GenerateUpdate* u = pending_.add_updates();
    u->set_stream_id(id);
    AddTokens(e.tokens, u->mutable_response());
    AddPromptLogprobs(e.prompt_logprobs, u->mutable_response());
    if (first) firsts_pending_.push_back(SteadyClock::now());
    if (e.finish) {
      SetFinish(*e.finish, u->mutable_response());
      SetLast(FinalStatus(*e.finish), u);
    }
  }

  static void SetLast(const grpc::Status& st, pb::GenerateUpdate* u) {
    u->set_last(true);
    u->set_status_code(static_cast<int32_t>(st.error_code()));
    if (!st.ok()) u->set_status_message(st.error_message());
  }

  void QueueRefusalLocked(uint64_t id, const grpc::Status& st) {
    pb::GenerateUpdate* u = pending_.add_updates();
    u->set_stream_id(id);
    SetLast(st, u);
  }

  // The call ends with `why` (the client is gone: it cancelled the call or a write failed; or it
  // broke the call's contract): what is pending is dropped, every request still on the call is
  // cancelled, and the call finishes once their final events have come.
  void AbandonLocked(const grpc::Status& why) {
    if (abandoned_) return;
    abandoned_ = true;
    end_status_ = why;
    pending_.Clear();
    firsts_pending_.clear();
    for (auto& [id, r] : requests_) CancelLocked(r);
  }

  // Starts the next write if there is something to write and none in flight; else finishes the
  // call once nothing can come any more.
  void AdvanceLocked() {
    if (finished_ || writing_) return;
    if (!abandoned_ && pending_.updates_size() > 0) {
      current_.Swap(&pending_);
      pending_.Clear();
      for (SteadyClock::time_point t : firsts_pending_) {
        if (registry_.options_.first_write_started != nullptr) {
          registry_.options_.first_write_started->Observe(SecondsSince(t));
        }
      }
      firsts_in_flight_.swap(firsts_pending_);
      firsts_pending_.clear();
      writing_ = true;
      StartWrite(&current_);
      return;
    }
    // An outstanding read may remain: gRPC completes it (not ok) before OnDone.
    if ((reads_ended_ || abandoned_) && requests_.empty()) {
      finished_ = true;
      Finish(end_status_);
    }
  }

  inline static const grpc::Status kClientGone{grpc::StatusCode::CANCELLED, "the client went away"};

  GenerateStreams& registry_;
  engine::Engine& engine_;
  const std::chrono::system_clock::time_point call_deadline_;
  std::mutex mu_;
  pb::GenerateStreamRequest in_;  // the message being read (one read at a time)
  absl::flat_hash_map<uint64_t, Request> requests_;  // by stream_id
  pb::GenerateStreamResponse pending_;  // updates not yet written
  pb::GenerateStreamResponse current_;  // the message being written
  std::vector<SteadyClock::time_point> firsts_pending_;    // first tokens' events in pending_
  std::vector<SteadyClock::time_point> firsts_in_flight_;  // and in current_
  bool writing_ = false;
  bool reads_ended_ = false;
  bool abandoned_ = false;
  grpc::Status end_status_;  // the call's status once it finishes (OK unless abandoned)
  bool finished_ = false;
};

grpc::ServerBidiReactor<pb::GenerateStreamRequest, pb::GenerateStreamResponse>*
GenerateStreams::Open(engine::Engine& engine, grpc::CallbackServerContext* ctx) {
  // Registered before its first read can start a request, so Flush sees its events.
  std::lock_guard<std::mutex> lock(mu_);
  auto* r = new GenerateStreamReactor(*this, engine, ctx);
  open_.push_back(r);
  return r;
}

void GenerateStreams::Flush() {
  std::lock_guard<std::mutex> lock(mu_);
  for (GenerateStreamReactor* r : open_) r->Flush();
}

void GenerateStreams::Remove(GenerateStreamReactor* r) {
  std::lock_guard<std::mutex> lock(mu_);
  open_.erase(std::find(open_.begin(), open_.end(), r));
}

}  // namespace exl3::router
