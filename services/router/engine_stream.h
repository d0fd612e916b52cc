// One engine's MoeRouter.Forward stream (a gRPC callback reactor over raw bytes) and the sink of
// its answers (services/router/answer_sink.h). Requests are read one after another and handed to
// the service (MoeRouterService::Submit) as they arrive, many in flight; answers are queued and
// written one at a time, the next write started by OnWriteDone, so whichever thread completes a
// request only queues (and at most starts a write), never waits. A client that stops reading its
// answers stops being read from (kMaxQueued). Owned by the service's registry until OnDone;
// requests in flight hold it too, and answers completed after the stream ended are dropped.
//
// gRPC's Start* calls never run reactions inline, so they are made under `mu`: that orders them
// against Finish (no operation is started after it).
#pragma once

#include <cstddef>
#include <deque>
#include <memory>

#include "absl/status/status.h"
#include "exl3serve/v1/exl3serve.pb.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/server_callback.h"
#include "grpcpp/support/status.h"
#include "services/router/answer_sink.h"

namespace exl3::router {

class MoeRouterService;

class EngineStream : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                     public AnswerSink,
                     public std::enable_shared_from_this<EngineStream> {
 public:
  static constexpr size_t kMaxQueued = 256;  // answers waiting for a slow reader

  explicit EngineStream(MoeRouterService* svc) : svc_(svc) {}

  // Starts reading (once registered with the service).
  void Begin();

  // AnswerSink. Queues an answer (any thread); an answer over --max-message-bytes is replaced by
  // an in-band RESOURCE_EXHAUSTED (gRPC would end the whole stream for it).
  void Answer(pb::MoeLayerResponse r, bool erase_id) override;
  void BeginHandling() override;
  void EndHandling() override;

  // gRPC's reactions.
  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  // A message that does not parse: the stream ends with INVALID_ARGUMENT saying why.
  void EndUnparsable(const absl::Status& why);
  // Calls Finish once nothing is left to do (under mu).
  void MaybeFinishLocked();
  // Starts writing out_.front() (under mu, writing_ set).
  void WriteFrontLocked();

  MoeRouterService* const svc_;
  grpc::ByteBuffer in_;                   // the read buffer
  pb::MoeLayerRequest req_;               // in_ parsed
  grpc::ByteBuffer wbuf_;                 // guarded by mu: out_.front() serialized
  grpc::Status end_status_;               // guarded by mu: why the stream ends early, or OK
  std::deque<pb::MoeLayerResponse> out_;  // guarded by mu: front is being written while writing_
  bool writing_ = false;                  // guarded by mu
  bool reads_done_ = false;               // guarded by mu
  bool read_paused_ = false;              // guarded by mu
  bool broken_ = false;                   // guarded by mu: a write failed
  bool finished_ = false;                 // guarded by mu: Finish called (or OnDone)
  int handling_ = 0;                      // guarded by mu: requests on the handler pool
};

}  // namespace exl3::router
