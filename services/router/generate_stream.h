// Generator.GenerateStream (proto/exl3serve/v1/exl3serve.proto): many requests on one bidi call,
// for a front end that keeps one call open per process. Generate costs one gRPC write per request
// per step on the engine's side and one read per request per step on the client's; at 64 streams
// both sides' gRPC work per token was most of what a front end added to the engine's own time to
// first token (bench/results/frontend.md). Here a step's updates of every request on a call go
// out as one message:
//
//  - the engine's events (on its loop thread) only append a GenerateUpdate to the call's pending
//    message, under the call's lock;
//  - once the loop has delivered a pass's events (EngineOptions::after_events), GenerateStreams::
//    Flush starts the write of every call's pending message on the loop itself: one write start
//    (tens of microseconds) per call per step, not per request;
//  - while a write is in flight, updates keep gathering; OnWriteDone starts the next write.
//
// A call's requests are started and cancelled by its messages' actions (a message at a time, on
// gRPC's threads; a client sends what it queued meanwhile in one message, so a burst of new
// requests costs one read, which matters where the engine's cores are busy with the forward
// pass). A refusal (Engine::Submit's error) is that request's last update, written at once; an
// action that breaks the call's contract (a start for an id already open, neither start nor
// cancel) ends the call INVALID_ARGUMENT, as a client that cannot tell its requests apart is
// lost. The call finishes once the client has half-closed and every request on it has had its
// last update written; a call the client cancels, or whose write fails, cancels every request
// still on it and finishes CANCELLED once the engine has sent their final events (so the engine
// never calls back into a finished call).
//
// The time from a request's first tokens to the write carrying them (started, and done) is
// measured as for Generate (GeneratorOptions::first_write_*).
#pragma once

#include <mutex>
#include <utility>
#include <vector>

#include "engine/core/engine.h"
#include "exl3serve/v1/exl3serve.grpc.pb.h"
#include "grpcpp/support/server_callback.h"
#include "services/router/generator_options.h"

namespace exl3::router {

class GenerateStreamReactor;

// The open GenerateStream calls of one engine.
class GenerateStreams {
 public:
  // `options`' histograms must outlive this object.
  explicit GenerateStreams(GeneratorOptions options) : options_(std::move(options)) {}

  // A new call's reactor, its requests submitted to `engine` (which must outlive the call); gRPC
  // deletes it after OnDone, which removes it from here first.
  grpc::ServerBidiReactor<::exl3serve::v1::GenerateStreamRequest,
                          ::exl3serve::v1::GenerateStreamResponse>*
  Open(engine::Engine& engine, grpc::CallbackServerContext* ctx);

  // Starts the write of every call's pending updates that has none in flight. On the engine's
  // loop thread, after each pass's events (EngineOptions::after_events).
  void Flush();

 private:
  friend class GenerateStreamReactor;
  void Remove(GenerateStreamReactor* r);

  const GeneratorOptions options_;
  std::mutex mu_;  // guards open_; taken before a call's own lock, never after it
  std::vector<GenerateStreamReactor*> open_;
};

}  // namespace exl3::router
