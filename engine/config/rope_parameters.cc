#include "engine/config/rope_parameters.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace exl3::engine {
namespace {

using nlohmann::json;

int IntOr(const json& j, const char* field, int fallback) {
  auto it = j.find(field);
  return it != j.end() && it->is_number_integer() ? it->get<int>() : fallback;
}

double NumberOr(const json& j, const char* field, double fallback) {
  auto it = j.find(field);
  return it != j.end() && it->is_number() ? it->get<double>() : fallback;
}

absl::Status Missing(const std::string& source, const std::string& field) {
  return absl::InvalidArgumentError(
      absl::StrCat(source, ": required field '", field, "' is missing or not a number"));
}

}  // namespace

double YarnMscale(double scale, double m) { return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; }

json MergedRopeParameters(const json& j) {
  json p = json::object();
  for (const char* k : {"rope_theta", "partial_rotary_factor"})
    if (j.contains(k) && !j[k].is_null()) p[k] = j[k];
  if (j.contains("rope_scaling") && j["rope_scaling"].is_object()) p.update(j["rope_scaling"]);
  if (j.contains("rope_parameters") && j["rope_parameters"].is_object())
    p.update(j["rope_parameters"]);
  if (!p.contains("rope_type") && p.contains("type")) p["rope_type"] = p["type"];
  return p;
}

absl::Status ParseRopeParameters(const json& p, int head, double partial,
                                 int max_position_embeddings, const std::string& source,
                                 RopeConfig* rope) {
  rope->theta = NumberOr(p, "rope_theta", 10000.0);
  const std::string type = p.value("rope_type", std::string("default"));
  if (type == "default") {
    rope->type = RopeType::kDefault;
  } else if (type == "linear") {
    rope->type = RopeType::kLinear;
  } else if (type == "dynamic") {
    rope->type = RopeType::kDynamic;
  } else if (type == "yarn") {
    rope->type = RopeType::kYarn;
  } else {
    return absl::UnimplementedError(absl::StrCat(
        source, ": rope type '", type, "' is not supported (default, linear, dynamic, yarn)"));
  }
  rope->rotary_dim = static_cast<int>(head * partial);
  if (rope->rotary_dim <= 0 || rope->rotary_dim % 2 != 0 || rope->rotary_dim > head)
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": rotary dimension ", rope->rotary_dim, " of a head of ", head,
                     " (partial_rotary_factor ", partial, ") must be even and in (0, head]"));
  if (rope->type == RopeType::kDefault) return absl::OkStatus();

  rope->factor = NumberOr(p, "factor", 0.0);
  if (rope->type != RopeType::kYarn && rope->factor <= 0.0) return Missing(source, "rope factor");
  if (rope->type == RopeType::kYarn) {
    rope->original_max_position = IntOr(p, "original_max_position_embeddings", 0);
    if (rope->original_max_position <= 0)
      return Missing(source, "rope original_max_position_embeddings");
    if (rope->factor <= 0.0)
      rope->factor = static_cast<double>(max_position_embeddings) / rope->original_max_position;
    const double mscale = NumberOr(p, "mscale", 0.0);
    const double mscale_all_dim = NumberOr(p, "mscale_all_dim", 0.0);
    if (p.contains("attention_factor") && p["attention_factor"].is_number()) {
      rope->attention_factor = p["attention_factor"].get<double>();
    } else if (mscale != 0.0 && mscale_all_dim != 0.0) {
      rope->attention_factor =
          YarnMscale(rope->factor, mscale) / YarnMscale(rope->factor, mscale_all_dim);
    } else {
      rope->attention_factor = YarnMscale(rope->factor, 1.0);
    }
    // transformers treats 0 / null like absent here.
    if (NumberOr(p, "beta_fast", 0.0) != 0.0) rope->beta_fast = p["beta_fast"].get<double>();
    if (NumberOr(p, "beta_slow", 0.0) != 0.0) rope->beta_slow = p["beta_slow"].get<double>();
    if (p.contains("truncate") && p["truncate"].is_boolean()) rope->truncate = p["truncate"];
  }
  rope->original_max_position =
      rope->original_max_position > 0 ? rope->original_max_position : max_position_embeddings;
  return absl::OkStatus();
}

}  // namespace exl3::engine
