// The router's Prometheus metrics, exactly the names of docs/metrics.md ("Router"). Every bounded
// label value (MoE layers x stages, status codes, the expert map's workers) is registered up front
// so each series exists at zero.
#pragma once

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace exl3::router {

enum class Stage { kGate = 0, kDispatch, kWorkers, kCombine, kTotal };
inline constexpr int kNumStages = 5;

class RouterMetrics {
 public:
  RouterMetrics(prometheus::Registry& registry, const std::vector<int>& moe_layers);

  // Adds the per-worker series for `name` (idempotent; called for every worker of a map).
  void AddWorker(const std::string& name);

  void ObserveStage(int layer, Stage stage, double seconds);
  void RequestOk(int layer, int tokens);
  void Error(const std::string& code_name);
  void Fanout(int workers) { fanout_->Observe(workers); }
  void Sent(size_t bytes) { sent_->Increment(static_cast<double>(bytes)); }
  void Received(size_t bytes) { received_->Increment(static_cast<double>(bytes)); }
  void WorkerRpc(const std::string& worker, double seconds);
  void WorkerUp(const std::string& worker, bool up);
  // Whether the stream to `worker` runs over same-host shared memory (else gRPC).
  void WorkerShm(const std::string& worker, bool shm);
  void Failover(const std::string& worker);
  // A sub-request withdrawn from a worker (cancel sent, or dropped before it was written).
  void WorkerCancel(int reason);
  prometheus::Gauge& in_flight() { return *in_flight_; }
  prometheus::Gauge& unserved() { return *unserved_; }
  prometheus::Gauge& ready() { return *ready_; }

 private:
  struct Worker {
    prometheus::Histogram* rpc;
    prometheus::Gauge* up;
    prometheus::Gauge* shm;
    prometheus::Counter* failovers;
  };
  struct Layer {
    prometheus::Histogram* stage[kNumStages];
    prometheus::Counter* requests;
    prometheus::Counter* tokens;
  };
  Worker* FindWorker(const std::string& name);

  prometheus::Family<prometheus::Histogram>& latency_fam_;
  prometheus::Family<prometheus::Counter>& requests_fam_;
  prometheus::Family<prometheus::Counter>& tokens_fam_;
  prometheus::Family<prometheus::Histogram>& fanout_fam_;
  prometheus::Family<prometheus::Counter>& sent_fam_;
  prometheus::Family<prometheus::Counter>& received_fam_;
  prometheus::Family<prometheus::Histogram>& rpc_fam_;
  prometheus::Family<prometheus::Gauge>& up_fam_;
  prometheus::Family<prometheus::Gauge>& shm_fam_;
  prometheus::Family<prometheus::Counter>& failovers_fam_;
  prometheus::Family<prometheus::Counter>& errors_fam_;
  prometheus::Family<prometheus::Gauge>& in_flight_fam_;
  prometheus::Family<prometheus::Gauge>& unserved_fam_;
  prometheus::Family<prometheus::Gauge>& ready_fam_;
  prometheus::Family<prometheus::Counter>& cancels_fam_;

  std::map<int, Layer> layers_;  // fixed after construction
  std::map<std::string, prometheus::Counter*> errors_;
  std::map<std::string, prometheus::Counter*> cancels_;  // by reason name, fixed after construction
  prometheus::Histogram* fanout_;
  prometheus::Counter* sent_;
  prometheus::Counter* received_;
  prometheus::Gauge* in_flight_;
  prometheus::Gauge* unserved_;
  prometheus::Gauge* ready_;
  std::mutex mu_;  // guards workers_ (grows on reload) and errors_ lookups of unknown codes
  std::map<std::string, Worker> workers_;
};

}  // namespace exl3::router
