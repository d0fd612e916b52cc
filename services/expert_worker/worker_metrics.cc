#include "services/expert_worker/worker_metrics.h"

#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "services/common/metrics.h"
#include "services/common/status.h"

namespace exl3::worker {

WorkerMetrics::WorkerMetrics(prometheus::Registry& r, const std::vector<int>& layers,
                             const std::vector<int>& experts, const std::string& backend,
                             const std::string& device, const std::string& version) {
  auto& latency = prometheus::BuildHistogram()
                      .Name("exl3_worker_layer_latency_seconds")
                      .Help("Time a request spends queued, in its batch's compute, and in total")
                      .Register(r);
  auto& batch_tokens = prometheus::BuildHistogram()
                           .Name("exl3_worker_batch_tokens")
                           .Help("Tokens per executed batch")
                           .Register(r);
  auto& batch_requests = prometheus::BuildHistogram()
                             .Name("exl3_worker_batch_requests")
                             .Help("Requests per executed batch")
                             .Register(r);
  auto& requests = prometheus::BuildCounter()
                       .Name("exl3_worker_requests_total")
                       .Help("Requests answered successfully")
                       .Register(r);
  auto& tokens = prometheus::BuildCounter()
                     .Name("exl3_worker_tokens_total")
                     .Help("Tokens computed")
                     .Register(r);
  for (int l : layers) {
    const std::string ls = std::to_string(l);
    Layer& m = layers_[l];
    m.queue = &latency.Add({{"layer", ls}, {"stage", "queue"}}, svc::LatencyBuckets());
    m.compute = &latency.Add({{"layer", ls}, {"stage", "compute"}}, svc::LatencyBuckets());
    m.total = &latency.Add({{"layer", ls}, {"stage", "total"}}, svc::LatencyBuckets());
    m.batch_tokens = &batch_tokens.Add({{"layer", ls}}, svc::TokenBuckets());
    m.batch_requests = &batch_requests.Add({{"layer", ls}}, svc::CountBuckets());
    m.requests = &requests.Add({{"layer", ls}});
    m.tokens = &tokens.Add({{"layer", ls}});
  }
  auto& errors = prometheus::BuildCounter()
                     .Name("exl3_worker_errors_total")
                     .Help("Requests answered with an error, by gRPC status code name")
                     .Register(r);
  for (const std::string& code : svc::AllStatusCodeNames()) {
    errors_.push_back(&errors.Add({{"code", code}}));
  }
  auto& expert_tokens = prometheus::BuildCounter()
                            .Name("exl3_worker_expert_tokens_total")
                            .Help("Tokens routed to each held expert (all layers)")
                            .Register(r);
  for (int e : experts) expert_tokens_[e] = &expert_tokens.Add({{"expert", std::to_string(e)}});

  auto& cancels = prometheus::BuildCounter()
                      .Name("exl3_worker_cancels_total")
                      .Help("Cancels received from callers, by reason and what became of the request")
                      .Register(r);
  std::vector<int> reasons = svc::AllCancelReasons();
  reasons.push_back(0);  // unspecified
  for (int reason : reasons) {
    for (const char* outcome : {"dropped", "completed", "late"}) {
      cancels_[{svc::CancelReasonName(reason), outcome}] =
          &cancels.Add({{"reason", svc::CancelReasonName(reason)}, {"outcome", outcome}});
    }
  }

  queue_depth_ = &prometheus::BuildGauge()
                      .Name("exl3_worker_queue_depth")
                      .Help("Requests waiting to be batched")
                      .Register(r)
                      .Add({});
  pinned_bytes_ = &prometheus::BuildGauge()
                       .Name("exl3_worker_pinned_bytes")
                       .Help("Weight bytes resident (device, registered or locked host memory)")
                       .Register(r)
                       .Add({});
  load_seconds_ = &prometheus::BuildGauge()
                       .Name("exl3_worker_load_seconds")
                       .Help("Time the model took to load")
                       .Register(r)
                       .Add({});
  model_files_changed_ = &prometheus::BuildGauge()
                              .Name("exl3_worker_model_files_changed")
                              .Help("Model files of held experts that changed on disk since the load "
                                    "(the weights served are the copy made at load)")
                              .Register(r)
                              .Add({});
  ready_ = &prometheus::BuildGauge()
                .Name("exl3_worker_ready")
                .Help("1 while serving, 0 while loading or draining")
                .Register(r)
                .Add({});
  prometheus::BuildGauge()
      .Name("exl3_worker_info")
      .Help("Build and backend identity (value 1)")
      .Register(r)
      .Add({{"backend", backend}, {"device", device}, {"version", version}})
      .Set(1);
}

WorkerMetrics::Layer* WorkerMetrics::layer(int l) {
  auto it = layers_.find(l);
  return it == layers_.end() ? nullptr : &it->second;
}

void WorkerMetrics::CountError(absl::StatusCode code) {
  const int c = static_cast<int>(code);
  errors_[(c >= 0 && c < static_cast<int>(errors_.size())) ? c : 2]->Increment();
}

void WorkerMetrics::CountExpertTokens(int expert, double tokens) {
  auto it = expert_tokens_.find(expert);
  if (it != expert_tokens_.end()) it->second->Increment(tokens);
}

void WorkerMetrics::CountCancel(int reason, const std::string& outcome) {
  auto it = cancels_.find({svc::CancelReasonName(reason), outcome});
  if (it != cancels_.end()) it->second->Increment();
}

}  // namespace exl3::worker
