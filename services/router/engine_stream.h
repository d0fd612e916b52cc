// One engine's MoeRouter.Forward stream and the sink of its answers (services/router/answer_sink.h),
// on the stream plumbing of services/common/bidi_stream.h (one write outstanding, back-pressure,
// finish when idle). Requests are read one after another and handed to the service
// (MoeRouterService::Submit) as they arrive, many in flight; whichever thread completes a request
// only queues its answer. A client that stops reading its answers stops being read from
// (kMaxQueued). Owned by the service's registry until the stream ends; requests in flight hold it
// too, and answers completed after the stream ended are dropped.
//
// The plumbing's mutex is AnswerSink::mu, which also guards `inflight` and handling_.
#pragma once

#include <cstddef>
#include <memory>

#include "exl3serve/v1/exl3serve.pb.h"
#include "services/common/bidi_stream.h"
#include "services/router/answer_sink.h"

namespace exl3::router {

class MoeRouterService;

class EngineStream
    : public AnswerSink,
      public svc::BidiStream<svc::ServerSide, pb::MoeLayerRequest, pb::MoeLayerResponse>,
      public std::enable_shared_from_this<EngineStream> {
 public:
  static constexpr size_t kMaxQueued = 256;  // answers waiting for a slow reader

  explicit EngineStream(MoeRouterService* svc);

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

  MoeRouterService* const svc_;
  int handling_ = 0;  // guarded by mu: requests on the handler pool
};

}  // namespace exl3::router
