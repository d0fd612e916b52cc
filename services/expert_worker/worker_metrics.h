// The expert worker's Prometheus metrics, exactly the names of docs/metrics.md, with every
// bounded label value (MoE layer, stage, status code, held expert) registered at construction so
// each series exists at zero.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace exl3::worker {

class WorkerMetrics {
 public:
  // `layers`: the MoE layers; `experts`: every routed expert id held in any layer.
  WorkerMetrics(prometheus::Registry& registry, const std::vector<int>& layers,
                const std::vector<int>& experts, const std::string& backend,
                const std::string& device, const std::string& version);

  struct Layer {
    prometheus::Histogram* queue = nullptr;    // stage="queue"
    prometheus::Histogram* compute = nullptr;  // stage="compute"
    prometheus::Histogram* total = nullptr;    // stage="total"
    prometheus::Histogram* batch_tokens = nullptr;
    prometheus::Histogram* batch_requests = nullptr;
    prometheus::Counter* requests = nullptr;
    prometheus::Counter* tokens = nullptr;
  };
  // Null for a layer that is not one of `layers`.
  Layer* layer(int l);
  void CountError(absl::StatusCode code);
  void CountExpertTokens(int expert, double tokens);
  // A cancel from the caller: `reason` a pb::CancelReason, `outcome` "dropped" (never computed,
  // or its remaining chunks dropped; answered CANCELLED), "completed" (already computing: answered
  // with its result) or "late" (not in flight: nothing to do).
  void CountCancel(int reason, const std::string& outcome);

  prometheus::Gauge& queue_depth() { return *queue_depth_; }
  prometheus::Gauge& pinned_bytes() { return *pinned_bytes_; }
  prometheus::Gauge& load_seconds() { return *load_seconds_; }
  prometheus::Gauge& ready() { return *ready_; }
  prometheus::Gauge& model_files_changed() { return *model_files_changed_; }

 private:
  std::map<int, Layer> layers_;
  std::vector<prometheus::Counter*> errors_;  // by code 0..16
  std::map<int, prometheus::Counter*> expert_tokens_;
  std::map<std::pair<std::string, std::string>, prometheus::Counter*> cancels_;  // (reason, outcome)
  prometheus::Gauge* queue_depth_ = nullptr;
  prometheus::Gauge* pinned_bytes_ = nullptr;
  prometheus::Gauge* load_seconds_ = nullptr;
  prometheus::Gauge* ready_ = nullptr;
  prometheus::Gauge* model_files_changed_ = nullptr;
};

}  // namespace exl3::worker
