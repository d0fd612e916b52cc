// The dispatcher of layer calls (services/router/layer_call.h): from the gate's routing to the
// workers and back.
// - Worker choice: per expert, among the serving holders (WorkerSet, services/router/worker_set.h)
//   that have not failed this call, the one with the shallowest queue (sub-requests outstanding on
//   its link, plus one once this call gives it a part), equal ones in turn (round robin): an
//   expert's replicas share the load, within one call and across calls. The shared expert on
//   workers goes preferably to a worker the call already sends a part.
// - Parts: one ExpertRequest per chosen worker with only the rows it needs (bytes copied in the
//   request's dtype), per row its (expert, weight) pairs, `shared_expert` when it also runs the
//   shared expert, and `timeout_us` = the time left.
// - Failover: a part that fails with a retryable code (svc::IsRetryable) goes to other serving
//   holders while the deadline allows; with none left, the call fails UNAVAILABLE naming the
//   experts and their holders.
// - Ending and cancellation: the call ends once (deadline, cancel, a part that failed for good, or
//   OK when everything is in); what it still has out is withdrawn from the workers.
// It talks to workers only through WorkerLink (services/router/worker_link.h), so its tests run
// on fake links (tests/services/router/dispatcher_test.cc).
//
//   Dispatcher d(metrics, [](const std::shared_ptr<LayerCall>& c, const absl::Status& st) {
//     ... answer c (MakeAnswer, services/router/combine.h) ...
//   });
//   d.Start(call, RoutedWork(*call, /*shared_on_workers=*/false));
//   ... the handler's own work (local shared expert) ...
//   d.HandlerDone(call);                // the call ends OK once its parts are in
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "services/common/deadline_timer.h"
#include "services/router/layer_call.h"
#include "services/router/router_metrics.h"

namespace exl3::router {

// The call's routing as work for the workers (every token's top-k), plus the shared expert of
// every row when `shared_on_workers` and the call asks for it.
Work RoutedWork(const LayerCall& c, bool shared_on_workers);

// "experts 1-2", "shared expert", "experts 1-2 and the shared expert".
std::string ExpertsText(std::vector<int32_t> experts, bool shared_expert);

class Dispatcher {
 public:
  // Called once per call when it ends, after what it had out was withdrawn.
  using EndFn = std::function<void(const std::shared_ptr<LayerCall>&, const absl::Status&)>;

  // `metrics` may be null.
  Dispatcher(RouterMetrics* metrics, EndFn on_end);
  ~Dispatcher();
  Dispatcher(const Dispatcher&) = delete;
  Dispatcher& operator=(const Dispatcher&) = delete;

  // Arms the call's deadline (when it has one) and sends its work. Parts answered later are added
  // to the call's sum on the links' threads.
  void Start(const std::shared_ptr<LayerCall>& c, Work work);
  // The handler is done with the call: it ends OK once no part is out.
  void HandlerDone(const std::shared_ptr<LayerCall>& c);
  // Ends the call now (once; later calls do nothing). With an error, the sub-requests it still has
  // out are withdrawn with `reason`.
  void End(const std::shared_ptr<LayerCall>& c, const absl::Status& st,
           pb::CancelReason reason = pb::CANCEL_REASON_FAILED);

  svc::DeadlineTimer& timer() { return timer_; }

 private:
  // Per chosen worker its part of the work, or the experts no serving holder has.
  struct Choice {
    std::map<int, Work> parts;
    std::vector<int32_t> unserved_routed;
    bool unserved_shared = false;
  };
  struct PartInFlight;

  void ArmDeadline(const std::shared_ptr<LayerCall>& c);
  void OnDeadline(const std::shared_ptr<LayerCall>& c);
  // Chooses workers for `work` and sends the parts. `failed_worker`: the work is the share that
  // worker failed (a failover, counted when other workers take all of it).
  void Send(const std::shared_ptr<LayerCall>& c, Work work, std::optional<int> failed_worker);
  Choice Choose(LayerCall& c, const Work& work);
  void FailUnserved(const std::shared_ptr<LayerCall>& c, const Choice& choice);
  void SendPart(const std::shared_ptr<LayerCall>& c, int worker, Work part, Clock::time_point now);
  void OnPartAnswer(const std::shared_ptr<LayerCall>& c, PartInFlight& part, absl::Status st,
                    pb::ExpertResponse* resp);
  // A part failed with `err`: sent elsewhere when retryable and time is left, else the call ends.
  void OnPartFailed(const std::shared_ptr<LayerCall>& c, int worker, Work part,
                    const absl::Status& err);
  void PartDone(const std::shared_ptr<LayerCall>& c);

  RouterMetrics* const metrics_;
  const EndFn on_end_;
  std::atomic<uint32_t> next_turn_{0};  // the round robin of equally loaded holders (Choose)
  svc::DeadlineTimer timer_;  // last: its thread stops before the members above go
};

}  // namespace exl3::router
