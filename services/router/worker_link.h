// The dispatcher's view of one expert worker: send a sub-request, withdraw it, and whether the
// worker serves. WorkerConn (services/router/worker_pool.h: a gRPC stream, with a shared-memory
// channel for a worker on this host) implements it; the dispatcher's unit tests implement it with
// fakes (tests/services/router/dispatcher_test.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "exl3serve/v1/exl3serve.pb.h"

namespace exl3::router {

namespace pb = ::exl3serve::v1;

// Called exactly once per accepted sub-request, on a thread of the link: OK with the worker's
// response (whose in-band status may still be an error), UNAVAILABLE when the link broke before
// the answer came, or CANCELLED when Cancel withdrew it before it was written.
using SubCallback = std::function<void(absl::Status, pb::ExpertResponse*)>;

class WorkerLink {
 public:
  // Names one accepted sub-request, for Cancel: the link's session it went out on (a link that
  // reconnected has a new one) and its id there.
  struct Ticket {
    std::weak_ptr<void> session;
    uint64_t id = 0;
  };

  virtual ~WorkerLink() = default;

  virtual const std::string& name() const = 0;
  virtual const std::string& address() const = 0;
  // Serving: identity checked, connected, answering.
  virtual bool up() const = 0;
  // Sub-requests sent and not yet answered.
  virtual int outstanding() const = 0;

  // Sends `req` (its id is overwritten); `request_bytes` is its serialized size. On OK, `cb`
  // will be called exactly once, possibly before Send returns. On error (not up, not reading)
  // `cb` is never called.
  virtual absl::StatusOr<Ticket> Send(pb::ExpertRequest req, size_t request_bytes,
                                      SubCallback cb) = 0;
  // Withdraws a sub-request whose answer is no longer needed; its callback still runs once (with
  // CANCELLED, or the worker's late answer). A sub-request already answered: nothing happens.
  virtual void Cancel(const Ticket& ticket, pb::CancelReason reason) = 0;
  // Ends the link for good (its pool is retired, or the router stops): what is in flight fails.
  virtual void Stop() = 0;
};

}  // namespace exl3::router
