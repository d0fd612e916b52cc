// Strict readers of a config.json object's fields for the MoE sections (model/config/*_moe.h):
// none throws, and each error names the field, the file and the architecture.
//
//   FieldReader r(file.text(), file.source(), "Qwen3MoeForCausalLM");
//   EXL3_RETURN_IF_ERROR(r.Int("moe_intermediate_size", &c.moe_intermediate_size));  // required
//   EXL3_RETURN_IF_ERROR(r.OptBool("norm_topk_prob", &c.norm_topk_prob));           // kept if absent
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "nlohmann/json.hpp"

namespace exl3 {

class FieldReader {
 public:
  FieldReader(const nlohmann::json& j, std::string source, std::string architecture)
      : j_(j), source_(std::move(source)), arch_(std::move(architecture)) {}

  absl::Status Missing(std::string_view field) const;
  absl::Status Bad(std::string_view field, std::string_view why) const;
  // Present and not null.
  bool Has(const char* f) const { return j_.contains(f) && !j_[f].is_null(); }

  // Integers in [0, 2^30].
  absl::Status Int(const char* f, int* out) const;
  absl::Status OptInt(const char* f, int* out) const;
  // A field that has two names: either may be present; both must then agree.
  absl::Status OneOfInt(const char* f, const char* alt, int* out) const;
  absl::Status OptFloat(const char* f, float* out) const;
  absl::Status OptBool(const char* f, bool* out) const;
  absl::Status OptString(const char* f, std::string* out) const;
  absl::Status OptStringList(const char* f, std::vector<std::string>* out) const;
  absl::Status OptIntList(const char* f, std::vector<int>* out) const;
  // A list of per-layer names, each `unset` or `set`, as a flag per layer (true where `set`):
  // the wrong length or another name is an error. Absent: *present is false, *flags untouched.
  absl::Status OptLayerFlags(const char* f, int num_layers, const std::string& unset,
                             const std::string& set, std::vector<bool>* flags, bool* present) const;

 private:
  const nlohmann::json& j_;
  std::string source_;
  std::string arch_;
};

}  // namespace exl3
