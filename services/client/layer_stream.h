// The stream of MoE layer requests an engine talks to, whatever is behind it: a MoeStream (gRPC to
// an exl3-router, services/client/moe_client.h) or an InProcessStream (the router's logic in the
// engine's process, services/router/in_process_router.h). Code written against LayerStream runs on
// either.
#pragma once

#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "exl3serve/v1/exl3serve.pb.h"

namespace exl3::client {

namespace pb = ::exl3serve::v1;

// Runs once per request: with the response (whose in-band status may be an error) or, when the
// stream ended before it was answered, with the stream's error and a null response.
using ResponseCallback = std::function<void(absl::Status, const pb::MoeLayerResponse*)>;

class LayerStream {
 public:
  virtual ~LayerStream() = default;
  // Sends `req` with a fresh id (overwriting req.id). `cb` runs exactly once unless Send fails.
  virtual absl::Status Send(pb::MoeLayerRequest& req, ResponseCallback cb) = 0;
  // Withdraws one request (`id`: req.id() after Send): it is answered CANCELLED unless it was
  // answered already. The stream and the other requests go on.
  virtual absl::Status CancelRequest(uint64_t id,
                                     pb::CancelReason reason = pb::CANCEL_REASON_CLIENT) = 0;
  // Ends the stream now: outstanding requests are answered (or called back) CANCELLED.
  virtual void Cancel() = 0;
  // Waits for the outstanding answers, then ends the stream; returns its status.
  virtual absl::Status Close() = 0;
};

}  // namespace exl3::client
