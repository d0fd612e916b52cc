// Prometheus helpers shared by the services: an HTTP endpoint (MetricsHttpServer) serving one
// registry on --metrics-listen, and the fixed histogram bucket sets. Metric names are a contract
// (docs/metrics.md): the services define their metrics with exactly those names and pre-register
// every bounded label value at start so each series exists at zero.
//
//   auto ep = MetricsEndpoint::Start("127.0.0.1:9461");   // "" = no HTTP endpoint
//   if (!ep.ok()) ...;                                      // address in use, bad address
//   auto& fam = prometheus::BuildHistogram().Name("exl3_worker_layer_latency_seconds")
//                   .Help("...").Register((*ep)->registry());
//   prometheus::Histogram& h = fam.Add({{"layer", "3"}, {"stage", "total"}}, LatencyBuckets());
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "services/common/metrics_http_server.h"

namespace exl3::svc {

class MetricsEndpoint {
 public:
  // Starts serving /metrics on `listen` (HOST:PORT; port 0 picks a free one). An empty `listen`
  // creates the registry without an HTTP endpoint (tests, embedded use).
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Start(const std::string& listen);
  ~MetricsEndpoint();

  prometheus::Registry& registry() { return *registry_; }
  std::shared_ptr<prometheus::Registry> registry_ptr() { return registry_; }
  // The bound TCP port, or 0 without an endpoint.
  int port() const;
  // The registry in Prometheus text format (what /metrics serves).
  std::string Scrape() const;

 private:
  MetricsEndpoint() = default;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<MetricsHttpServer> server_;
};

// 10 µs .. ~10 s, roughly x2 per bucket: per-layer latencies span decode (tens of µs on a GPU)
// to long prefills.
prometheus::Histogram::BucketBoundaries LatencyBuckets();
// 1, 2, 4, ..., 65536: tokens per batch.
prometheus::Histogram::BucketBoundaries TokenBuckets();
// 1, 2, 4, ..., 1024: requests per batch, fan-out widths.
prometheus::Histogram::BucketBoundaries CountBuckets();

}  // namespace exl3::svc
