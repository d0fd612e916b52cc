// The workers a layer call is dispatched over (WorkerLinks, services/router/worker_link.h) and
// which of them holds which expert. An expert-map reload builds a new set; a layer call keeps the
// set it started with until it ends (services/router/retired_pools.h frees an old set after
// that). WorkerPool (services/router/worker_pool.h) is the set of real worker connections; the
// dispatcher's tests build sets of fake links.
//
//   ExpertHolders h(cfg.num_hidden_layers, cfg.num_experts, cfg.MoeLayers(), /*shared_on_workers=*/true);
//   h.AddRouted(layer, expert, 0);  h.AddShared(layer, 1);    // worker indices into the links
//   auto set = std::make_shared<WorkerSet>(std::move(links), std::move(h));
//   for (int w : set->holders().Routed(layer, expert)) set->link(w).up();
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/expert_map.h"
#include "model/moe_config.h"
#include "services/router/worker_link.h"

namespace exl3::router {

// Per layer: the workers holding each routed expert, and (when the shared expert runs on workers,
// --shared-expert worker:NAME) those holding the shared expert; worker indices in map order.
class ExpertHolders {
 public:
  ExpertHolders() = default;
  // `shared_on_workers`: the shared expert runs on workers (their AddShared), not on the router.
  ExpertHolders(int num_layers, int num_experts, std::vector<int> moe_layers,
                bool shared_on_workers);
  // From an expert map: worker i of the set is map.workers[i]. With `shared_on_workers`, the
  // workers named in `shared_expert_workers` (SharedExpertWorkers' order) hold the shared expert
  // of every MoE layer.
  static ExpertHolders FromMap(const ExpertMap& map, const MoeConfig& cfg, bool shared_on_workers,
                               const std::vector<std::string>& shared_expert_workers);

  void AddRouted(int layer, int expert, int worker);
  void AddShared(int layer, int worker);

  const std::vector<int>& Routed(int layer, int expert) const { return routed_[layer][expert]; }
  const std::vector<int>& Shared(int layer) const { return shared_[layer]; }
  bool shared_on_workers() const { return shared_on_workers_; }
  const std::vector<int>& moe_layers() const { return moe_layers_; }
  int num_experts() const { return num_experts_; }

 private:
  int num_experts_ = 0;
  std::vector<int> moe_layers_;
  std::vector<std::vector<std::vector<int>>> routed_;  // [layer][expert] -> workers
  std::vector<std::vector<int>> shared_;               // [layer] -> workers
  bool shared_on_workers_ = false;
};

class WorkerSet {
 public:
  WorkerSet(std::vector<std::shared_ptr<WorkerLink>> links, ExpertHolders holders);
  virtual ~WorkerSet() = default;
  WorkerSet(const WorkerSet&) = delete;
  WorkerSet& operator=(const WorkerSet&) = delete;

  int num_workers() const { return static_cast<int>(links_.size()); }
  WorkerLink& link(int i) const { return *links_[i]; }
  const ExpertHolders& holders() const { return holders_; }
  bool shared_on_workers() const { return holders_.shared_on_workers(); }

  // Routed experts (all MoE layers) without any up worker, plus one per MoE layer whose shared
  // expert has none when it runs on workers.
  int UnservedExperts() const;
  // Stops the links that `next` does not also hold (after a reload swapped sets).
  void StopUnshared(const WorkerSet& next) const;
  void StopAll() const;

 protected:
  const std::vector<std::shared_ptr<WorkerLink>>& links() const { return links_; }

 private:
  const std::vector<std::shared_ptr<WorkerLink>> links_;
  const ExpertHolders holders_;
};

}  // namespace exl3::router
