#include "services/common/metrics.h"

#include <exception>

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
  try {
    // civetweb wants "[::1]:port" for IPv6 and "host:port" otherwise; HOST:PORT passes through.
    ep->exposer_ = std::make_unique<prometheus::Exposer>(listen, /*num_threads=*/2);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", listen, ": ", e.what()));
  }
  ep->exposer_->RegisterCollectable(ep->registry_);
  return ep;
}

MetricsEndpoint::~MetricsEndpoint() {
  if (exposer_) exposer_->RemoveCollectable(registry_);
}

int MetricsEndpoint::port() const {
  if (!exposer_) return 0;
  const auto ports = exposer_->GetListeningPorts();
  return ports.empty() ? 0 : ports[0];
}

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
