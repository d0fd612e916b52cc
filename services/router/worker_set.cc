#include "services/router/worker_set.h"

#include <utility>

namespace exl3::router {

ExpertHolders::ExpertHolders(int num_layers, int num_experts, std::vector<int> moe_layers,
                             bool shared_on_workers)
    : num_experts_(num_experts),
      moe_layers_(std::move(moe_layers)),
      routed_(num_layers, std::vector<std::vector<int>>(num_experts)),
      shared_(num_layers),
      shared_on_workers_(shared_on_workers) {}

ExpertHolders ExpertHolders::FromMap(const ExpertMap& map, const MoeConfig& cfg,
                                     bool shared_on_workers,
                                     const std::vector<std::string>& shared_expert_workers) {
  ExpertHolders h(cfg.num_hidden_layers, cfg.num_experts, cfg.MoeLayers(), shared_on_workers);
  for (size_t i = 0; i < map.workers.size(); ++i) {
    const ExpertMapWorker& w = map.workers[i];
    for (int L = 0; L < cfg.num_hidden_layers && L < static_cast<int>(w.experts.size()); ++L) {
      for (int e : w.experts[L]) h.AddRouted(L, e, static_cast<int>(i));
    }
  }
  if (!shared_on_workers) return h;
  // The named worker first, then its replicas.
  for (const std::string& name : shared_expert_workers) {
    for (size_t i = 0; i < map.workers.size(); ++i) {
      if (map.workers[i].name != name) continue;
      for (int L : h.moe_layers_) h.AddShared(L, static_cast<int>(i));
    }
  }
  return h;
}

void ExpertHolders::AddRouted(int layer, int expert, int worker) {
  routed_[layer][expert].push_back(worker);
}

void ExpertHolders::AddShared(int layer, int worker) { shared_[layer].push_back(worker); }

WorkerSet::WorkerSet(std::vector<std::shared_ptr<WorkerLink>> links, ExpertHolders holders)
    : links_(std::move(links)), holders_(std::move(holders)) {}

int WorkerSet::UnservedExperts() const {
  auto any_up = [&](const std::vector<int>& workers) {
    for (int i : workers) {
      if (links_[i]->up()) return true;
    }
    return false;
  };
  int n = 0;
  for (int L : holders_.moe_layers()) {
    for (int e = 0; e < holders_.num_experts(); ++e) n += any_up(holders_.Routed(L, e)) ? 0 : 1;
    if (holders_.shared_on_workers() && !any_up(holders_.Shared(L))) ++n;
  }
  return n;
}

void WorkerSet::StopUnshared(const WorkerSet& next) const {
  for (const auto& w : links_) {
    bool shared = false;
    for (const auto& n : next.links_) shared |= n == w;
    if (!shared) w->Stop();
  }
}

void WorkerSet::StopAll() const {
  for (const auto& w : links_) w->Stop();
}

}  // namespace exl3::router
