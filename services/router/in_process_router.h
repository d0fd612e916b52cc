// The router's logic in an engine's own process: the engine -> worker path then has one gRPC hop
// (to the workers) instead of two (engine -> exl3-router -> workers).
//
//   InProcessRouterOptions o;
//   o.core.model_dir = "/models/m"; o.core.expert_map_path = "map.yaml";  // as exl3-router's flags
//   auto router = InProcessRouter::Create(o);           // loads, connects, waits until ready
//   std::unique_ptr<InProcessStream> s = (*router)->OpenStream();
//   pb::MoeLayerRequest req = client::MakeLayerRequest(layer, x.data(), T, hidden, pb::DTYPE_FP16);
//   s->Send(req, [](absl::Status st, const pb::MoeLayerResponse* r) { ... });
//   s->Close();
//
// A request on an InProcessStream has exactly the semantics of one on an exl3-router Forward stream
// (validation, routing, deadlines, cancels, --max-in-flight, metrics): both go through
// MoeRouterService::Submit. Differences: the callback runs on whichever thread completes the
// request (a worker stream's thread, the deadline timer, or the caller's own thread inside Send
// when the request fails validation or all its work is local), so it must not block; and the
// answer is not serialized (its output is encoded in the requested dtype all the same).
// Streams must be closed (or destroyed) before their router.
#pragma once

#include <chrono>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "services/client/layer_stream.h"
#include "services/common/metrics.h"
#include "services/router/router_core.h"

namespace exl3::router {

struct InProcessRouterOptions {
  RouterCoreOptions core;
  // Create waits this long for every routed expert to have a serving worker (0: does not wait).
  std::chrono::milliseconds ready_timeout{30000};
};

class InProcessSink;

class InProcessStream final : public client::LayerStream {
 public:
  // A stream straight into a router service that this process runs (exl3-router's engine uses
  // the service it also serves over gRPC).
  static std::unique_ptr<InProcessStream> Open(MoeRouterService& svc, int inline_max_tokens);
  ~InProcessStream() override;  // Close()
  absl::Status Send(pb::MoeLayerRequest& req, client::ResponseCallback cb) override;
  // Send of a request the stream may take apart (no copy of its hidden states). `out` (may be
  // null): a buffer of T x hidden floats that the caller keeps until `cb` ran; with an fp32
  // output_dtype the answer's sum is accumulated there and the response carries no output tensor
  // (after an error answer its contents are undefined).
  absl::Status SendOwned(pb::MoeLayerRequest req, float* out, client::ResponseCallback cb);
  absl::Status CancelRequest(uint64_t id,
                             pb::CancelReason reason = pb::CANCEL_REASON_CLIENT) override;
  // Requests in flight are answered CANCELLED (their work withdrawn from the workers); callbacks
  // of requests not yet in flight run with CANCELLED and a null response.
  void Cancel() override;
  // Waits for every outstanding answer (each request ends by its deadline at the latest).
  absl::Status Close() override;
  int in_flight() const;

 private:
  friend class InProcessRouter;
  InProcessStream(MoeRouterService& svc, int inline_max_tokens);
  MoeRouterService& svc_;
  const int inline_max_tokens_;
  std::shared_ptr<InProcessSink> sink_;
};

class InProcessRouter {
 public:
  // Builds what exl3-router builds (RouterCore) and waits until ready (o.ready_timeout); an error
  // when loading fails or the workers do not all serve in time.
  static absl::StatusOr<std::unique_ptr<InProcessRouter>> Create(const InProcessRouterOptions& o);
  ~InProcessRouter();  // stops the worker connections
  std::unique_ptr<InProcessStream> OpenStream();
  RouterCore& core() { return *core_; }
  // The router's metrics (exl3-router's /metrics), in Prometheus text format.
  std::string ScrapeMetrics() const { return metrics_->Scrape(); }

 private:
  InProcessRouter() = default;
  std::unique_ptr<svc::MetricsEndpoint> metrics_;  // the registry only, no HTTP endpoint
  std::unique_ptr<RouterCore> core_;
  int inline_max_tokens_ = 0;
};

}  // namespace exl3::router
