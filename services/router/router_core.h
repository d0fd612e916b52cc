// What exl3-router runs, without the gRPC server in front: the model (config, router weights,
// shared experts), the expert map, the worker pool (channels to the workers, health watching,
// reconnects), the metrics and the MoeRouterService. Built by exl3-router's main.cc and by
// InProcessRouter (an engine using the router's logic in its own process).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/config/config_file.h"
#include "model/exl3_model.h"
#include "model/expert_map.h"
#include "prometheus/registry.h"
#include "services/common/server.h"
#include "services/router/moe_router.h"
#include "services/router/retired_pools.h"
#include "services/router/router_metrics.h"
#include "services/router/worker_pool.h"

namespace exl3::router {

struct RouterCoreOptions {
  std::string model_dir;
  std::string expert_map_path;
  // The router weights and any shared expert held here (model/safetensors.h TensorResidency).
  TensorResidency residency = TensorResidency::kOwned;
  // shared_expert_local / shared_expert_worker say where the shared expert runs.
  RouterOptions router;
  svc::ClientTls worker_tls;  // enabled=false: plaintext (a warning for non-loopback workers)
  int max_message_bytes = 64 << 20;
  int reconnect_backoff_max_ms = 2000;
  // Same-host workers: shared-memory channel per direction (0: gRPC only), its reader's spin.
  size_t worker_shm_bytes = 8 << 20;
  int shm_spin_us = 200;
  // A worker silent this long (no liveness probe reply, no answer) is marked down and its
  // sub-requests failed over (WorkerPoolOptions::liveness_ms); 0: no probes.
  int worker_liveness_ms = 1500;
};

class RouterCore {
 public:
  // Loads and checks everything (model, map coverage, the shared expert's workers, worker TLS
  // files), registers the metrics in `registry` (which must outlive the core) and starts connecting
  // to the workers in the background. Errors name the problem.
  // Reads o.model_dir's config.json (ConfigFile::Read).
  static absl::StatusOr<std::unique_ptr<RouterCore>> Create(const RouterCoreOptions& o,
                                                            prometheus::Registry& registry);
  // `config`: o.model_dir's config.json as the caller read it; the file is not read again
  // (exl3-router hands the same read to the engine: Generation::Start).
  static absl::StatusOr<std::unique_ptr<RouterCore>> Create(const RouterCoreOptions& o, const ConfigFile& config,
                                                            prometheus::Registry& registry);
  ~RouterCore();  // Stop()

  MoeRouterService& service() { return *service_; }
  RouterMetrics& metrics() { return *metrics_; }
  const Exl3Model& model() const { return *model_; }
  const ExpertMap& map() const { return map_; }

  // Ready: every routed expert (and, with --shared-expert worker:NAME, the shared expert) has a
  // serving worker, and not draining.
  bool Ready() const { return readiness_.load() == Readiness::kReady; }
  bool WaitReady(std::chrono::milliseconds timeout);
  // Called (on a worker's thread, or the caller's of StartDrain/ReloadMap) after readiness is
  // recomputed, with the new value; replaces the previous listener (nullptr: none).
  void SetReadyListener(std::function<void(bool)> fn);
  // Recomputes readiness (metrics, log on change, listener).
  void UpdateReady();
  // New requests are refused with UNAVAILABLE; readiness drops.
  void StartDrain();
  // Reloads the expert map from its file (exl3-router's SIGHUP); on error the previous map stays.
  // Connections to workers that left the map are stopped; the old pool is freed once the
  // requests that started on it have ended.
  absl::Status ReloadMap();
  // Old pools not freed yet (requests that started on them still running).
  int retired_pools() const { return retired_.size(); }
  // Stops every worker connection (current and retired pools). Requests still in flight fail.
  void Stop();

 private:
  RouterCore() = default;
  absl::Status CheckShared(const ExpertMap& m) const;

  RouterCoreOptions opt_;
  std::unique_ptr<Exl3Model> model_;
  ExpertMap map_;  // the map as loaded first (ReloadMap does not update it)
  std::unique_ptr<RouterMetrics> metrics_;
  WorkerPoolOptions popt_;
  std::unique_ptr<MoeRouterService> service_;
  std::atomic<bool> draining_{false};
  // kUnknown until UpdateReady first runs, so its first result is always logged.
  enum class Readiness { kUnknown, kReady, kNotReady };
  std::atomic<Readiness> readiness_{Readiness::kUnknown};
  std::mutex listener_mu_;  // held while the listener runs
  std::function<void(bool)> listener_;
  std::mutex ready_mu_;
  std::condition_variable ready_cv_;
  std::mutex reload_mu_;
  bool stopped_ = false;  // guarded by reload_mu_
  RetiredPools retired_;  // old pools, freed once unused
};

}  // namespace exl3::router
