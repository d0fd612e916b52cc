// One engine's MoeRouter.Forward stream and the sink of its answers (services/router/answer_sink.h),
// on the stream plumbing of services/common/bidi_stream.h (one write outstanding, back-pressure,
// finish when idle). Requests are read one after another and handed to the service that owns the
// stream (EngineStreamService: MoeRouterService, services/router/moe_router.h) as they arrive, many
// in flight; whichever thread completes a request only queues its answer. A client that stops reading its answers stops being read from
// (kMaxQueued). Owned by the service's registry until the stream ends; requests in flight hold it
// too, and answers completed after the stream ended are dropped.
//
// The plumbing's mutex is AnswerSink::mu, which also guards `inflight` and handling_.
#pragma once

#include <cstddef>
#include <memory>

#include "absl/status/status.h"
#include "exl3serve/v1/exl3serve.pb.h"
#include "services/common/bidi_stream.h"
#include "services/router/answer_sink.h"

namespace exl3::router {

class EngineStream;

// What a stream needs of the service that owns it.
class EngineStreamService {
 public:
  virtual ~EngineStreamService() = default;
  // One request (or a cancel message) read from `s`; `req` may be moved from.
  virtual void OnStreamRequest(const std::shared_ptr<AnswerSink>& s, pb::MoeLayerRequest& req) = 0;
  // The stream's caller is gone: its requests in flight end now.
  virtual void CancelStream(AnswerSink& s) = 0;
  // The stream has ended: the service drops its reference (which may be the last).
  virtual void StreamEnded(EngineStream* s) = 0;
  // --max-message-bytes, and the in-band error for an answer of `bytes` bytes over it.
  virtual size_t max_message_bytes() const = 0;
  virtual absl::Status AnswerTooLarge(size_t bytes) const = 0;
};

class EngineStream
    : public AnswerSink,
      public svc::BidiStream<svc::ServerSide, pb::MoeLayerRequest, pb::MoeLayerResponse>,
      public std::enable_shared_from_this<EngineStream> {
 public:
  static constexpr size_t kMaxQueued = 256;  // answers waiting for a slow reader

  explicit EngineStream(EngineStreamService* svc);

  // AnswerSink. Queues an answer (any thread); an answer over --max-message-bytes is replaced by
  // an in-band RESOURCE_EXHAUSTED (gRPC would end the whole stream for it).
  void Answer(pb::MoeLayerResponse r, bool erase_id) override;
  void BeginHandling() override;
  void EndHandling() override;

 private:
  // The plumbing's hooks.
  void OnMessage(pb::MoeLayerRequest& req, svc::Path from) override;
  bool OwesAnswersLocked() const override;
  // Nobody is left to answer (the client cancelled, a write failed, a message did not parse):
  // the requests in flight end now, which withdraws their work from the workers.
  void OnAbandoned() override;
  void OnEnded(const grpc::Status& st) override;

  EngineStreamService* const svc_;
  int handling_ = 0;  // guarded by mu: requests on the handler pool
};

}  // namespace exl3::router
