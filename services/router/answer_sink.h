// Where the answers of one stream of layer requests go: a gRPC Forward stream
// (services/router/engine_stream.h) or an in-process caller (InProcessStream,
// services/router/in_process_router.h). The request path (MoeRouterService::Submit) sees only this.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "exl3serve/v1/exl3serve.pb.h"

namespace exl3::router {

namespace pb = ::exl3serve::v1;

struct LayerCall;

class AnswerSink {
 public:
  virtual ~AnswerSink() = default;
  // Queues or delivers an answer (any thread). With `erase_id`, the request also leaves `inflight`
  // in the same step: the caller may reuse the id once it has the answer.
  virtual void Answer(pb::MoeLayerResponse r, bool erase_id) = 0;
  // A request handed to the handler pool: the sink must not end before it is handled.
  virtual void BeginHandling() {}
  virtual void EndHandling() {}

  std::atomic<bool> cancelled{false};  // the caller cancelled (or left): nothing is answered
  // Taken with no LayerCall::mu held (services/router/layer_call.h, "Locks").
  std::mutex mu;
  std::unordered_map<uint64_t, std::shared_ptr<LayerCall>> inflight;  // guarded by mu
};

}  // namespace exl3::router
