#include "model/config/json_fields.h"

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace exl3 {

using nlohmann::json;

absl::Status FieldReader::Missing(std::string_view field) const {
  return absl::InvalidArgumentError(absl::StrCat(source_, ": required field '", std::string(field),
                                                 "' is missing (", arch_, ")"));
}

absl::Status FieldReader::Bad(std::string_view field, std::string_view why) const {
  return absl::InvalidArgumentError(
      absl::StrCat(source_, ": field '", std::string(field), "' ", std::string(why)));
}

absl::Status FieldReader::Int(const char* f, int* out) const {
  if (!Has(f)) return Missing(f);
  return OptInt(f, out);
}

absl::Status FieldReader::OptInt(const char* f, int* out) const {
  if (!Has(f)) return absl::OkStatus();
  const json& v = j_[f];
  if (!v.is_number_integer()) return Bad(f, "is not an integer");
  const int64_t x = v.get<int64_t>();
  if (x < 0 || x > (1 << 30)) return Bad(f, absl::StrCat("has out-of-range value ", x));
  *out = static_cast<int>(x);
  return absl::OkStatus();
}

absl::Status FieldReader::OneOfInt(const char* f, const char* alt, int* out) const {
  if (!Has(f) && !Has(alt)) {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": required field '", f, "' (or '",
                                                   alt, "') is missing (", arch_, ")"));
  }
  int a = -1, b = -1;
  EXL3_RETURN_IF_ERROR(OptInt(f, &a));
  EXL3_RETURN_IF_ERROR(OptInt(alt, &b));
  if (a >= 0 && b >= 0 && a != b) {
    return Bad(f, absl::StrCat("is ", a, " but '", alt, "' is ", b));
  }
  *out = a >= 0 ? a : b;
  return absl::OkStatus();
}

absl::Status FieldReader::OptFloat(const char* f, float* out) const {
  if (!Has(f)) return absl::OkStatus();
  const json& v = j_[f];
  if (!v.is_number()) return Bad(f, "is not a number");
  *out = v.get<float>();
  return absl::OkStatus();
}

absl::Status FieldReader::OptBool(const char* f, bool* out) const {
  if (!Has(f)) return absl::OkStatus();
  const json& v = j_[f];
  if (!v.is_boolean()) return Bad(f, "is not a boolean");
  *out = v.get<bool>();
  return absl::OkStatus();
}

absl::Status FieldReader::OptString(const char* f, std::string* out) const {
  if (!Has(f)) return absl::OkStatus();
  const json& v = j_[f];
  if (!v.is_string()) return Bad(f, "is not a string");
  *out = v.get<std::string>();
  return absl::OkStatus();
}

absl::Status FieldReader::OptStringList(const char* f, std::vector<std::string>* out) const {
  if (!Has(f)) return absl::OkStatus();
  const json& v = j_[f];
  if (!v.is_array()) return Bad(f, "is not a list");
  for (const auto& e : v) {
    if (!e.is_string()) return Bad(f, "holds a non-string");
    out->push_back(e.get<std::string>());
  }
  return absl::OkStatus();
}

absl::Status FieldReader::OptIntList(const char* f, std::vector<int>* out) const {
  if (!Has(f)) return absl::OkStatus();
  const json& v = j_[f];
  if (!v.is_array()) return Bad(f, "is not a list");
  for (const auto& e : v) {
    if (!e.is_number_integer()) return Bad(f, "holds a non-integer");
    out->push_back(e.get<int>());
  }
  return absl::OkStatus();
}

absl::Status FieldReader::OptLayerFlags(const char* f, int num_layers, const std::string& unset,
                                        const std::string& set, std::vector<bool>* flags,
                                        bool* present) const {
  std::vector<std::string> kinds;
  EXL3_RETURN_IF_ERROR(OptStringList(f, &kinds));
  *present = !kinds.empty();
  if (!*present) return absl::OkStatus();
  if (static_cast<int>(kinds.size()) != num_layers) {
    return Bad(f, absl::StrCat("has ", kinds.size(), " entries for ", num_layers, " layers"));
  }
  for (int l = 0; l < num_layers; ++l) {
    if (kinds[l] != unset && kinds[l] != set) {
      return Bad(f, absl::StrCat("entry ", l, " is '", kinds[l], "', not '", unset, "' or '", set, "'"));
    }
    (*flags)[l] = kinds[l] == set;
  }
  return absl::OkStatus();
}

}  // namespace exl3
