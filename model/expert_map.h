// The expert map: which worker process holds which routed experts of which MoE layer
// (YAML, format in docs/expert-map.md). Read by the router (whole map) and by a worker started
// with `--expert-map FILE --worker NAME` (its own entry).
//
// Usage:
//   absl::StatusOr<ExpertMap> map = LoadExpertMap("map.yaml", cfg);   // parsed + resolved
//   absl::Status cover = CheckCoverage(*map, cfg);  // every routed expert has >= 1 worker
//   const ExpertMapWorker* w = map->Find("w0");
//   for (int layer : cfg.MoeLayers()) for (int e : w->experts[layer]) ...
//
// Expert and layer sets are written as ranges: "0-31", "0-7,12,20-23", a YAML integer, a YAML
// list of integers, or "all".
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/index_ranges.h"
#include "model/moe_config.h"

namespace exl3 {

struct ExpertMapWorker {
  std::string name;
  std::string address;     // host:port as given to gRPC
  std::string replica_of;  // name of the worker whose experts this one copies, or empty
  // experts[layer]: sorted, unique routed expert ids held for that layer; empty for layers that
  // are not MoE. Sized cfg.num_hidden_layers.
  std::vector<std::vector<int32_t>> experts;
  // `shared_expert: true`: also holds the shared expert of every MoE layer (for a router started
  // with --shared-expert worker:NAME). A replica_of copies it. May be a worker's only share.
  bool shared_expert = false;

  bool Holds(int layer, int expert) const;
  size_t TotalExperts() const;  // sum over layers
};

struct ExpertMap {
  std::vector<ExpertMapWorker> workers;  // in file order
  std::string source;                    // file it came from, for messages

  const ExpertMapWorker* Find(std::string_view name) const;
};

// Parses YAML text and resolves it against the model's MoE layout: layer lists must name MoE
// layers, expert ids must be < cfg.num_experts, names unique and non-empty, addresses non-empty,
// replica_of must name another worker without a replica_of of its own. `source` names the file in
// messages. Coverage is NOT checked here (see CheckCoverage).
absl::StatusOr<ExpertMap> ParseExpertMap(std::string_view yaml_text, std::string_view source,
                                         const MoeConfig& cfg);
absl::StatusOr<ExpertMap> LoadExpertMap(const std::string& path, const MoeConfig& cfg);

// OK when every routed expert of every MoE layer is held by at least one worker in `map`
// (restricted to `usable` workers when given: usable[i] for map.workers[i]). Otherwise
// FAILED_PRECONDITION with a message naming the gaps, e.g.
// "expert map map.yaml: no worker holds layer 3 experts 5-7, layer 4 experts 5-7".
absl::Status CheckCoverage(const ExpertMap& map, const MoeConfig& cfg,
                           const std::vector<bool>* usable = nullptr);

}  // namespace exl3
