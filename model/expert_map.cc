#include "model/expert_map.h"

#include <algorithm>
#include <cctype>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "yaml-cpp/yaml.h"

namespace exl3 {

bool ExpertMapWorker::Holds(int layer, int expert) const {
  if (layer < 0 || layer >= static_cast<int>(experts.size())) return false;
  return std::binary_search(experts[layer].begin(), experts[layer].end(), expert);
}

size_t ExpertMapWorker::TotalExperts() const {
  size_t n = 0;
  for (const auto& l : experts) n += l.size();
  return n;
}

const ExpertMapWorker* ExpertMap::Find(std::string_view name) const {
  for (const auto& w : workers) {
    if (w.name == name) return &w;
  }
  return nullptr;
}

namespace {

std::string Where(const YAML::Node& n) {
  const YAML::Mark m = n.Mark();
  if (m.line < 0) return "";
  return absl::StrCat(" (line ", m.line + 1, ")");
}

// A range given as a YAML scalar ("0-7,9", 5, "all") or a sequence of integers.
absl::StatusOr<std::vector<int32_t>> NodeRanges(const YAML::Node& n, int limit) {
  if (n.IsScalar()) return ParseIndexRanges(n.Scalar(), limit);
  if (n.IsSequence()) {
    std::vector<std::string> parts;
    for (const auto& item : n) {
      if (!item.IsScalar()) return absl::InvalidArgumentError("a list of indices must hold integers");
      parts.push_back(item.Scalar());
    }
    return ParseIndexRanges(absl::StrJoin(parts, ","), limit);
  }
  return absl::InvalidArgumentError("expected a range such as \"0-31\" or a list of integers");
}

absl::Status Err(std::string_view source, const std::string& msg) {
  return absl::InvalidArgumentError(absl::StrCat("expert map ", std::string(source), ": ", msg));
}

}  // namespace

absl::StatusOr<ExpertMap> ParseExpertMap(std::string_view yaml_text, std::string_view source,
                                         const MoeConfig& cfg) {
  YAML::Node root;
  try {
    root = YAML::Load(std::string(yaml_text));
  } catch (const YAML::Exception& e) {
    return Err(source, absl::StrCat("not valid YAML: ", e.what()));
  }
  if (!root.IsMap() || !root["workers"] || !root["workers"].IsSequence()) {
    return Err(source, "expected a top-level mapping with a \"workers\" list");
  }
  for (const auto& kv : root) {
    const std::string key = kv.first.Scalar();
    if (key != "workers") {
      return Err(source, absl::StrCat("unknown top-level key \"", key, "\"", Where(kv.first)));
    }
  }
  const std::vector<int> moe_layers = cfg.MoeLayers();
  ExpertMap map;
  map.source = std::string(source);
  std::set<std::string> names;
  for (const auto& wn : root["workers"]) {
    if (!wn.IsMap()) return Err(source, absl::StrCat("each worker must be a mapping", Where(wn)));
    ExpertMapWorker w;
    w.experts.assign(cfg.num_hidden_layers, {});
    for (const auto& kv : wn) {
      const std::string key = kv.first.Scalar();
      if (key != "name" && key != "address" && key != "experts" && key != "replica_of" &&
          key != "shared_expert") {
        return Err(source, absl::StrCat("unknown worker key \"", key, "\"", Where(kv.first)));
      }
    }
    if (!wn["name"] || !wn["name"].IsScalar() || wn["name"].Scalar().empty()) {
      return Err(source, absl::StrCat("a worker has no name", Where(wn)));
    }
    w.name = wn["name"].Scalar();
    if (!names.insert(w.name).second) {
      return Err(source, absl::StrCat("worker name \"", w.name, "\" used twice", Where(wn)));
    }
    const std::string label = absl::StrCat("worker \"", w.name, "\"");
    if (!wn["address"] || !wn["address"].IsScalar() || wn["address"].Scalar().empty()) {
      return Err(source, absl::StrCat(label, " has no address", Where(wn)));
    }
    w.address = wn["address"].Scalar();
    if (wn["shared_expert"]) {
      const YAML::Node sn = wn["shared_expert"];
      const std::string v = sn.IsScalar() ? sn.Scalar() : "";
      if (v == "true") {
        w.shared_expert = true;
      } else if (v != "false") {
        return Err(source, absl::StrCat(label, ": shared_expert must be true or false", Where(sn)));
      }
    }
    if (wn["replica_of"]) {
      if (wn["experts"]) {
        return Err(source, absl::StrCat(label, " has both experts and replica_of", Where(wn)));
      }
      w.replica_of = wn["replica_of"].Scalar();
      map.workers.push_back(std::move(w));
      continue;
    }
    const YAML::Node en = wn["experts"];
    if (!en && w.shared_expert) {  // the shared expert only
      map.workers.push_back(std::move(w));
      continue;
    }
    if (!en) return Err(source, absl::StrCat(label, " has neither experts nor replica_of", Where(wn)));
    const bool per_layer = en.IsSequence() && en.size() > 0 && en[0].IsMap();
    if (!per_layer) {
      // One expert set for every MoE layer.
      auto ex = NodeRanges(en, cfg.num_experts);
      if (!ex.ok()) return Err(source, absl::StrCat(label, " experts: ", ex.status().message(), Where(en)));
      for (int L : moe_layers) w.experts[L] = *ex;
    } else {
      for (const auto& entry : en) {
        if (!entry.IsMap() || !entry["layers"] || !entry["experts"]) {
          return Err(source, absl::StrCat(label, ": each per-layer entry needs layers and experts",
                                          Where(entry)));
        }
        std::vector<int32_t> layers;
        if (entry["layers"].IsScalar() && entry["layers"].Scalar() == "all") {
          layers.assign(moe_layers.begin(), moe_layers.end());
        } else {
          auto ls = NodeRanges(entry["layers"], cfg.num_hidden_layers);
          if (!ls.ok()) {
            return Err(source, absl::StrCat(label, " layers: ", ls.status().message(),
                                            Where(entry["layers"])));
          }
          layers = *ls;
        }
        auto ex = NodeRanges(entry["experts"], cfg.num_experts);
        if (!ex.ok()) {
          return Err(source, absl::StrCat(label, " experts: ", ex.status().message(),
                                          Where(entry["experts"])));
        }
        for (int L : layers) {
          if (!cfg.IsMoeLayer(L)) {
            return Err(source, absl::StrCat(label, ": layer ", L, " is not an MoE layer (MoE layers: ",
                                            FormatIndexRanges(std::vector<int32_t>(
                                                moe_layers.begin(), moe_layers.end())),
                                            ")", Where(entry["layers"])));
          }
          auto& dst = w.experts[L];
          dst.insert(dst.end(), ex->begin(), ex->end());
          std::sort(dst.begin(), dst.end());
          dst.erase(std::unique(dst.begin(), dst.end()), dst.end());
        }
      }
    }
    if (w.TotalExperts() == 0) return Err(source, absl::StrCat(label, " holds no experts", Where(wn)));
    map.workers.push_back(std::move(w));
  }
  if (map.workers.empty()) return Err(source, "the workers list is empty");
  // Resolve replica_of (one level: a replica copies a worker that lists its experts itself).
  for (auto& w : map.workers) {
    if (w.replica_of.empty()) continue;
    const ExpertMapWorker* of = nullptr;
    for (const auto& o : map.workers) {
      if (o.name == w.replica_of) of = &o;
    }
    if (of == nullptr || of == &w) {
      return Err(source, absl::StrCat("worker \"", w.name, "\": replica_of names unknown worker \"",
                                      w.replica_of, "\""));
    }
    if (!of->replica_of.empty()) {
      return Err(source, absl::StrCat("worker \"", w.name, "\": replica_of \"", w.replica_of,
                                      "\" is itself a replica; name the original"));
    }
    w.experts = of->experts;
    w.shared_expert = w.shared_expert || of->shared_expert;
  }
  return map;
}

absl::StatusOr<ExpertMap> LoadExpertMap(const std::string& path, const MoeConfig& cfg) {
  std::ifstream f(path);
  if (!f) return absl::NotFoundError(absl::StrCat("expert map ", path, ": cannot open"));
  std::stringstream ss;
  ss << f.rdbuf();
  return ParseExpertMap(ss.str(), path, cfg);
}

absl::Status CheckCoverage(const ExpertMap& map, const MoeConfig& cfg,
                           const std::vector<bool>* usable) {
  // Group layers with identical gaps so a map missing the same experts everywhere gives one line.
  std::map<std::vector<int32_t>, std::vector<int32_t>> layers_by_gap;
  for (int L : cfg.MoeLayers()) {
    std::vector<bool> held(cfg.num_experts, false);
    for (size_t i = 0; i < map.workers.size(); ++i) {
      if (usable != nullptr && !(*usable)[i]) continue;
      const auto& w = map.workers[i];
      if (L < static_cast<int>(w.experts.size())) {
        for (int e : w.experts[L]) held[e] = true;
      }
    }
    std::vector<int32_t> gap;
    for (int e = 0; e < cfg.num_experts; ++e) {
      if (!held[e]) gap.push_back(e);
    }
    if (!gap.empty()) layers_by_gap[gap].push_back(L);
  }
  if (layers_by_gap.empty()) return absl::OkStatus();
  std::vector<std::string> parts;
  for (const auto& [gap, layers] : layers_by_gap) {
    parts.push_back(absl::StrCat(layers.size() == 1 ? "layer " : "layers ",
                                 FormatIndexRanges(layers), " experts ", FormatIndexRanges(gap)));
  }
  return absl::FailedPreconditionError(
      absl::StrCat("expert map ", map.source, ": no ", usable ? "serving " : "",
                   "worker holds ", absl::StrJoin(parts, "; ")));
}

}  // namespace exl3
