#include "services/router/router_core.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "base/status_macros.h"

namespace exl3::router {
namespace {

absl::Status CheckPathsGiven(const RouterCoreOptions& o) {
  if (o.model_dir.empty()) return absl::InvalidArgumentError("--model DIR is required");
  if (o.expert_map_path.empty()) return absl::InvalidArgumentError("--expert-map FILE is required");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<RouterCore>> RouterCore::Create(const RouterCoreOptions& o,
                                                               prometheus::Registry& registry) {
  EXL3_RETURN_IF_ERROR(CheckPathsGiven(o));
  EXL3_ASSIGN_OR_RETURN(const ConfigFile config, ConfigFile::Read(o.model_dir + "/config.json"));
  return Create(o, config, registry);
}

absl::StatusOr<std::unique_ptr<RouterCore>> RouterCore::Create(const RouterCoreOptions& o, const ConfigFile& config,
                                                               prometheus::Registry& registry) {
  EXL3_RETURN_IF_ERROR(CheckPathsGiven(o));
  std::unique_ptr<RouterCore> core(new RouterCore());
  core->opt_ = o;
  core->opt_.router.max_message_bytes = o.max_message_bytes;
  const RouterOptions& ropt = core->opt_.router;

  // The model: config, router weights, shared experts; no routed experts.
  Exl3ModelOptions mopt;
  mopt.experts = std::map<int, std::vector<int>>{};
  mopt.load_shared_experts = ropt.shared_expert_local;
  mopt.load_routers = true;
  mopt.residency = o.residency;
  const auto t0 = std::chrono::steady_clock::now();
  auto model = Exl3Model::Open(o.model_dir, config, mopt);
  if (!model.ok()) return model.status();
  core->model_ = std::move(*model);
  const MoeConfig& cfg = core->model_->config();
  if (!core->model_->fingerprint_covers_weights()) {
    exl3::LogWarning("%s", core->model_->UncoveredWeightsWarning().c_str());
  }
  exl3::LogInfo("model %s: %s, %d MoE layers x %d experts (top-%d), fingerprint %s, loaded in %.2f s",
               o.model_dir.c_str(), cfg.architecture.c_str(), static_cast<int>(cfg.MoeLayers().size()),
               cfg.num_experts, cfg.top_k, core->model_->fingerprint().c_str(),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());

  auto map = LoadExpertMap(o.expert_map_path, cfg);
  if (!map.ok()) return map.status();
  core->map_ = std::move(*map);
  if (absl::Status cover = CheckCoverage(core->map_, cfg); !cover.ok()) return cover;
  if (absl::Status sh = core->CheckShared(core->map_); !sh.ok()) return sh;

  WorkerPoolOptions& popt = core->popt_;
  popt.fingerprint = core->model_->fingerprint();
  popt.max_message_bytes = o.max_message_bytes;
  popt.backoff_max_ms = o.reconnect_backoff_max_ms;
  popt.shared_expert_worker = ropt.shared_expert_worker;
  popt.shm_ring_bytes = o.worker_shm_bytes;
  popt.shm_spin_us = o.shm_spin_us;
  popt.liveness_ms = o.worker_liveness_ms;
  popt.tls = o.worker_tls;
  if (popt.tls.cert_file.empty() != popt.tls.key_file.empty()) {
    return absl::InvalidArgumentError("--worker-tls-cert and --worker-tls-key go together");
  }
  if (popt.tls.enabled) {
    auto creds = svc::MakeChannelCredentials(popt.tls);
    if (!creds.ok()) return creds.status();
  } else {
    for (const auto& w : core->map_.workers) {
      if (!svc::IsLoopbackAddress(w.address)) {
        exl3::LogWarning("!!! worker %s at %s is reached WITHOUT TLS: hidden states cross the network "
                        "in clear text. Use --worker-tls-ca (and --worker-tls-cert/--worker-tls-key "
                        "for mTLS). !!!", w.name.c_str(), w.address.c_str());
      }
    }
  }

  core->metrics_ = std::make_unique<RouterMetrics>(registry, cfg.MoeLayers());
  core->service_ =
      std::make_unique<MoeRouterService>(*core->model_, ropt, core->metrics_.get());
  popt.spare_buffers = core->service_->spare_buffers();
  RouterCore* self = core.get();
  popt.on_change = [self] { self->UpdateReady(); };
  core->service_->SetPool(WorkerPool::Create(core->map_, cfg, popt, nullptr, core->metrics_.get()));
  core->UpdateReady();
  return core;
}

RouterCore::~RouterCore() { Stop(); }

absl::Status RouterCore::CheckShared(const ExpertMap& m) const {
  const RouterOptions& ropt = opt_.router;
  if (ropt.shared_expert_worker.empty()) return absl::OkStatus();
  const MoeConfig& cfg = model_->config();
  if (!cfg.has_shared_expert()) {
    return absl::FailedPreconditionError(
        absl::StrCat("--shared-expert worker:", ropt.shared_expert_worker, ": the model (",
                     cfg.architecture, ") has no shared expert"));
  }
  return SharedExpertWorkers(m, ropt.shared_expert_worker).status();
}

void RouterCore::UpdateReady() {
  auto p = service_ ? service_->pool() : nullptr;
  if (!p) return;
  const int unserved = p->UnservedExperts();
  const bool ready = unserved == 0 && !draining_;
  metrics_->unserved().Set(unserved);
  metrics_->ready().Set(ready ? 1 : 0);
  {
    std::lock_guard<std::mutex> l(listener_mu_);
    if (listener_) listener_(ready);
  }
  const Readiness now = ready ? Readiness::kReady : Readiness::kNotReady;
  if (readiness_.exchange(now) != now) {
    const bool shared_on_workers = !opt_.router.shared_expert_worker.empty();
    if (ready) {
      exl3::LogInfo("ready: every routed expert%s has a serving worker",
                   shared_on_workers ? " and the shared expert" : "");
    } else if (draining_) {
      exl3::LogWarning("not ready: draining (new requests are refused)");
    } else {
      exl3::LogWarning("not ready: %d %s have no serving worker", unserved,
                      shared_on_workers ? "routed experts (and per-layer shared experts)"
                                        : "routed experts");
    }
  }
  std::lock_guard<std::mutex> l(ready_mu_);
  ready_cv_.notify_all();
}

bool RouterCore::WaitReady(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> l(ready_mu_);
  return ready_cv_.wait_for(l, timeout, [&] { return Ready(); });
}

void RouterCore::SetReadyListener(std::function<void(bool)> fn) {
  std::lock_guard<std::mutex> l(listener_mu_);
  listener_ = std::move(fn);
}

void RouterCore::StartDrain() {
  draining_ = true;
  service_->StartDrain();
  UpdateReady();
}

absl::Status RouterCore::ReloadMap() {
  const MoeConfig& cfg = model_->config();
  auto next = LoadExpertMap(opt_.expert_map_path, cfg);
  absl::Status st = next.ok() ? CheckCoverage(*next, cfg) : next.status();
  if (st.ok()) st = CheckShared(*next);
  if (!st.ok()) return st;
  {
    std::lock_guard<std::mutex> l(reload_mu_);
    if (stopped_) return absl::FailedPreconditionError("the router is stopped");
    auto old = service_->pool();
    auto fresh = WorkerPool::Create(*next, cfg, popt_, old.get(), metrics_.get());
    service_->SetPool(fresh);
    old->StopUnshared(*fresh);
    retired_.Retire(std::move(old));
  }
  UpdateReady();
  return absl::OkStatus();
}

void RouterCore::Stop() {
  std::lock_guard<std::mutex> l(reload_mu_);
  if (stopped_ || !service_) return;
  stopped_ = true;
  if (auto p = service_->pool()) p->StopAll();
  retired_.StopAll();
}

}  // namespace exl3::router
