#include "services/router/router_metrics.h"

#include "services/common/metrics.h"
#include "services/common/status.h"

namespace exl3::router {

namespace {
const char* kStageNames[kNumStages] = {"gate", "dispatch", "workers", "combine", "total"};
}

RouterMetrics::RouterMetrics(prometheus::Registry& r, const std::vector<int>& moe_layers)
    : latency_fam_(prometheus::BuildHistogram()
                       .Name("exl3_router_layer_latency_seconds")
                       .Help("Per-layer time by stage (gate, dispatch, workers, combine, total)")
                       .Register(r)),
      requests_fam_(prometheus::BuildCounter()
                        .Name("exl3_router_requests_total")
                        .Help("Layer requests answered successfully")
                        .Register(r)),
      tokens_fam_(prometheus::BuildCounter()
                      .Name("exl3_router_tokens_total")
                      .Help("Tokens routed")
                      .Register(r)),
      fanout_fam_(prometheus::BuildHistogram()
                      .Name("exl3_router_fanout_width")
                      .Help("Workers one layer request fans out to")
                      .Register(r)),
      sent_fam_(prometheus::BuildCounter()
                    .Name("exl3_router_sent_bytes_total")
                    .Help("Bytes sent to workers")
                    .Register(r)),
      received_fam_(prometheus::BuildCounter()
                        .Name("exl3_router_received_bytes_total")
                        .Help("Bytes received from workers")
                        .Register(r)),
      rpc_fam_(prometheus::BuildHistogram()
                   .Name("exl3_router_worker_rpc_latency_seconds")
                   .Help("Round trip of one worker sub-request")
                   .Register(r)),
      up_fam_(prometheus::BuildGauge()
                  .Name("exl3_router_worker_up")
                  .Help("1 while the worker's health is SERVING (and its model matches)")
                  .Register(r)),
      shm_fam_(prometheus::BuildGauge()
                   .Name("exl3_router_worker_shm")
                   .Help("1 while the stream to the worker runs over same-host shared memory")
                   .Register(r)),
      failovers_fam_(prometheus::BuildCounter()
                         .Name("exl3_router_failovers_total")
                         .Help("Sub-requests re-sent to a replica after that worker failed")
                         .Register(r)),
      errors_fam_(prometheus::BuildCounter()
                      .Name("exl3_router_errors_total")
                      .Help("Layer requests answered with an error, by gRPC status code")
                      .Register(r)),
      in_flight_fam_(prometheus::BuildGauge()
                         .Name("exl3_router_requests_in_flight")
                         .Help("Layer requests accepted and not yet answered")
                         .Register(r)),
      unserved_fam_(prometheus::BuildGauge()
                        .Name("exl3_router_unserved_experts")
                        .Help("Routed experts (all layers) with no serving worker")
                        .Register(r)),
      ready_fam_(prometheus::BuildGauge()
                     .Name("exl3_router_ready")
                     .Help("1 while every expert has a serving worker")
                     .Register(r)),
      cancels_fam_(prometheus::BuildCounter()
                       .Name("exl3_router_worker_cancels_total")
                       .Help("Worker sub-requests withdrawn because their answer was no longer "
                             "needed, by reason")
                       .Register(r)) {
  for (int L : moe_layers) {
    Layer l;
    const std::string ls = std::to_string(L);
    for (int s = 0; s < kNumStages; ++s) {
      l.stage[s] = &latency_fam_.Add({{"layer", ls}, {"stage", kStageNames[s]}},
                                     svc::LatencyBuckets());
    }
    l.requests = &requests_fam_.Add({{"layer", ls}});
    l.tokens = &tokens_fam_.Add({{"layer", ls}});
    layers_[L] = l;
  }
  for (const std::string& c : svc::AllStatusCodeNames()) errors_[c] = &errors_fam_.Add({{"code", c}});
  for (int reason : svc::AllCancelReasons()) {
    const std::string name = svc::CancelReasonName(reason);
    cancels_[name] = &cancels_fam_.Add({{"reason", name}});
  }
  fanout_ = &fanout_fam_.Add({}, svc::CountBuckets());
  sent_ = &sent_fam_.Add({});
  received_ = &received_fam_.Add({});
  in_flight_ = &in_flight_fam_.Add({});
  unserved_ = &unserved_fam_.Add({});
  ready_ = &ready_fam_.Add({});
}

void RouterMetrics::AddWorker(const std::string& name) {
  std::lock_guard<std::mutex> l(mu_);
  if (workers_.count(name)) return;
  Worker w;
  w.rpc = &rpc_fam_.Add({{"worker", name}}, svc::LatencyBuckets());
  w.up = &up_fam_.Add({{"worker", name}});
  w.shm = &shm_fam_.Add({{"worker", name}});
  w.failovers = &failovers_fam_.Add({{"worker", name}});
  workers_[name] = w;
}

RouterMetrics::Worker* RouterMetrics::FindWorker(const std::string& name) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = workers_.find(name);
  return it == workers_.end() ? nullptr : &it->second;
}

void RouterMetrics::ObserveStage(int layer, Stage stage, double seconds) {
  auto it = layers_.find(layer);
  if (it != layers_.end()) it->second.stage[static_cast<int>(stage)]->Observe(seconds);
}

void RouterMetrics::RequestOk(int layer, int tokens) {
  auto it = layers_.find(layer);
  if (it == layers_.end()) return;
  it->second.requests->Increment();
  it->second.tokens->Increment(tokens);
}

void RouterMetrics::Error(const std::string& code) {
  auto it = errors_.find(code);
  if (it != errors_.end()) it->second->Increment();
}

void RouterMetrics::WorkerRpc(const std::string& worker, double seconds) {
  if (Worker* w = FindWorker(worker)) w->rpc->Observe(seconds);
}

void RouterMetrics::WorkerUp(const std::string& worker, bool up) {
  if (Worker* w = FindWorker(worker)) w->up->Set(up ? 1 : 0);
}

void RouterMetrics::WorkerShm(const std::string& worker, bool shm) {
  if (Worker* w = FindWorker(worker)) w->shm->Set(shm ? 1 : 0);
}

void RouterMetrics::Failover(const std::string& worker) {
  if (Worker* w = FindWorker(worker)) w->failovers->Increment();
}

void RouterMetrics::WorkerCancel(int reason) {
  auto it = cancels_.find(svc::CancelReasonName(reason));
  if (it != cancels_.end()) it->second->Increment();
}

}  // namespace exl3::router
