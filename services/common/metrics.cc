#include "services/common/metrics.h"

#include "absl/strings/str_cat.h"
#include "prometheus/text_serializer.h"

namespace exl3::svc {

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(const std::string& listen) {
  std::unique_ptr<MetricsEndpoint> ep(new MetricsEndpoint());
  ep->registry_ = std::make_shared<prometheus::Registry>();
  if (listen.empty()) return ep;
  if (listen.find(':') == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics-listen '", listen, "' is not HOST:PORT"));
  }
  MetricsEndpoint* raw = ep.get();
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> server =
      MetricsHttpServer::Start(listen, [raw] { return raw->Scrape(); });
  if (!server.ok()) return server.status();
  ep->server_ = std::move(*server);
  return ep;
}

MetricsEndpoint::~MetricsEndpoint() { server_.reset(); }  // stop scrapes before the registry goes

int MetricsEndpoint::port() const { return server_ ? server_->port() : 0; }

std::string MetricsEndpoint::Scrape() const {
  prometheus::TextSerializer ser;
  return ser.Serialize(registry_->Collect());
}

prometheus::Histogram::BucketBoundaries LatencyBuckets() {
  prometheus::Histogram::BucketBoundaries b;
  double v = 10e-6;
  for (int i = 0; i < 21; ++i, v *= 2) b.push_back(v);  // 10 µs .. 10.5 s
  return b;
}

prometheus::Histogram::BucketBoundaries TokenBuckets() {
  prometheus::Histogram::BucketBoundaries b;
  for (double v = 1; v <= 65536; v *= 2) b.push_back(v);
  return b;
}

prometheus::Histogram::BucketBoundaries CountBuckets() {
  prometheus::Histogram::BucketBoundaries b;
  for (double v = 1; v <= 1024; v *= 2) b.push_back(v);
  return b;
}

}  // namespace exl3::svc
