#include "model/exl3_storage.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/codebook.h"
#include "nlohmann/json.hpp"

namespace exl3 {
namespace {

using json = nlohmann::json;

std::string ShapeStr(const std::vector<int64_t>& s) {
  return absl::StrCat("[", absl::StrJoin(s, ", "), "]");
}

// torch's dtype spelling, as exllamav3 records it.
bool ParseTorchDType(std::string_view name, DType* out) {
  static const std::pair<std::string_view, DType> kNames[] = {
      {"torch.bool", DType::kBool},     {"torch.uint8", DType::kU8},
      {"torch.int8", DType::kI8},       {"torch.int16", DType::kI16},
      {"torch.uint16", DType::kU16},    {"torch.float16", DType::kF16},
      {"torch.bfloat16", DType::kBF16}, {"torch.int32", DType::kI32},
      {"torch.uint32", DType::kU32},    {"torch.float32", DType::kF32},
      {"torch.int64", DType::kI64},     {"torch.uint64", DType::kU64},
      {"torch.float64", DType::kF64},   {"torch.float8_e4m3fn", DType::kF8E4M3},
      {"torch.float8_e5m2", DType::kF8E5M2}};
  for (const auto& [n, d] : kNames) {
    if (n == name) {
      *out = d;
      return true;
    }
  }
  return false;
}

absl::Status Bad(std::string_view source, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(std::string(source), ": ", what));
}

}  // namespace

bool ModuleRecord::quantized_embedding() const {
  return tensors.count(key + ".trellis") > 0 && tensors.count(key + ".signs") > 0;
}

absl::StatusOr<Exl3Storage> ParseExl3Storage(std::string_view json_text, std::string_view source) {
  const json j = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Bad(source, "not a JSON object");
  Exl3Storage s;
  auto str = [&](const char* k, std::string* out) -> absl::Status {
    if (!j.contains(k)) return absl::OkStatus();
    if (!j[k].is_string()) return Bad(source, absl::StrCat("'", k, "' is not a string"));
    *out = j[k].get<std::string>();
    return absl::OkStatus();
  };
  auto num = [&](const char* k, double* out) -> absl::Status {
    if (!j.contains(k)) return absl::OkStatus();
    if (!j[k].is_number()) return Bad(source, absl::StrCat("'", k, "' is not a number"));
    *out = j[k].get<double>();
    return absl::OkStatus();
  };
  if (absl::Status st = str("quant_method", &s.quant_method); !st.ok()) return st;
  if (absl::Status st = str("version", &s.version); !st.ok()) return st;
  if (absl::Status st = str("codebook", &s.codebook); !st.ok()) return st;
  if (absl::Status st = num("bits", &s.bits); !st.ok()) return st;
  if (absl::Status st = num("head_bits", &s.head_bits); !st.ok()) return st;
  if (s.quant_method != "exl3") {
    return Bad(source, absl::StrCat("quant_method is '", s.quant_method, "', expected 'exl3'"));
  }
  if (!j.contains("tensor_storage") || !j["tensor_storage"].is_object()) {
    return Bad(source, "has no tensor_storage object");
  }
  for (const auto& [key, m] : j["tensor_storage"].items()) {
    const std::string where = absl::StrCat("tensor_storage['", key, "']");
    if (!m.is_object()) return Bad(source, where + " is not an object");
    ModuleRecord r;
    r.key = key;
    if (m.contains("quant_format")) {
      if (!m["quant_format"].is_string() || m["quant_format"].get<std::string>() != "exl3") {
        return Bad(source, absl::StrCat(where, ": quant_format ", m["quant_format"].dump(),
                                        " is not supported (only \"exl3\")"));
      }
      r.storage = ModuleStorage::kExl3;
      if (!m.contains("bits_per_weight") || !m["bits_per_weight"].is_number()) {
        return Bad(source, where + ": an exl3 module without a numeric bits_per_weight");
      }
      r.bits_per_weight = m["bits_per_weight"].get<double>();
      for (const auto& [field, out] : {std::pair<const char*, uint32_t*>{"mcg_multiplier",
                                                                         &r.mcg_multiplier},
                                       {"mul1_multiplier", &r.mul1_multiplier}}) {
        if (!m.contains(field)) continue;
        if (!m[field].is_number_unsigned() || m[field].get<uint64_t>() > 0xffffffffull) {
          return Bad(source, absl::StrCat(where, ": ", field, " is not a 32-bit unsigned number"));
        }
        *out = static_cast<uint32_t>(m[field].get<uint64_t>());
      }
    }
    if (!m.contains("stored_tensors") || !m["stored_tensors"].is_object()) {
      return Bad(source, where + " has no stored_tensors object");
    }
    for (const auto& [name, t] : m["stored_tensors"].items()) {
      const std::string twhere = absl::StrCat(where, ".stored_tensors['", name, "']");
      StoredTensorRecord rec;
      if (!t.is_object() || !t.contains("shape") || !t["shape"].is_array() ||
          !t.contains("n_bytes") || !t["n_bytes"].is_number_unsigned() || !t.contains("dtype") ||
          !t["dtype"].is_string()) {
        return Bad(source, twhere + " needs shape (array), n_bytes (number) and dtype (string)");
      }
      for (const auto& d : t["shape"]) {
        if (!d.is_number_integer() || d.get<int64_t>() < 0) {
          return Bad(source, twhere + ": shape holds something other than a size");
        }
        rec.shape.push_back(d.get<int64_t>());
      }
      rec.bytes = t["n_bytes"].get<uint64_t>();
      if (!ParseTorchDType(t["dtype"].get<std::string>(), &rec.dtype)) {
        return Bad(source, absl::StrCat(twhere, ": dtype '", t["dtype"].get<std::string>(),
                                        "' is not one this project reads"));
      }
      r.tensors[name] = std::move(rec);
    }
    s.modules[key] = std::move(r);
  }
  return s;
}

absl::StatusOr<std::optional<Exl3Storage>> ReadExl3Storage(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path path = fs::path(dir) / kExl3StorageFile;
  std::error_code ec;
  if (!fs::exists(path, ec)) return std::optional<Exl3Storage>();
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path.string()));
  std::stringstream ss;
  ss << in.rdbuf();
  absl::StatusOr<Exl3Storage> s = ParseExl3Storage(ss.str(), path.string());
  if (!s.ok()) return s.status();
  return std::optional<Exl3Storage>(std::move(*s));
}

absl::Status CheckExl3Storage(const Exl3Storage& storage, const TensorSource& src) {
  // The record names tensors as stored; the source serves them under the project's names.
  auto project = [&](const std::string& stored) { return ProjectTensorName(src.naming(), stored); };
  auto bad = [](const ModuleRecord& m, const std::string& what) {
    return absl::DataLossError(absl::StrCat(kExl3StorageFile, ": module '", m.key, "': ", what));
  };
  for (const auto& [key, m] : storage.modules) {
    for (const auto& [name, rec] : m.tensors) {
      const std::string pname = project(name);
      if (!src.Has(pname)) return bad(m, absl::StrCat("tensor '", name, "' is not in the model"));
      absl::StatusOr<const TensorInfo*> info = src.Info(pname);
      if (!info.ok()) return info.status();
      if ((*info)->dtype != rec.dtype || (*info)->shape != rec.shape ||
          (*info)->size_bytes() != rec.bytes) {
        return bad(m, absl::StrCat("tensor '", name, "' is ", std::string(DTypeName((*info)->dtype)), " ",
                                   ShapeStr((*info)->shape), " (", (*info)->size_bytes(),
                                   " bytes), the record says ", std::string(DTypeName(rec.dtype)), " ",
                                   ShapeStr(rec.shape), " (", rec.bytes, " bytes)"));
      }
    }
    if (m.storage != ModuleStorage::kExl3) continue;
    auto trellis = m.tensors.find(key + ".trellis");
    if (trellis == m.tensors.end() || trellis->second.shape.size() != 3) {
      return bad(m, "an exl3 module without a 3-dimensional trellis");
    }
    const double width_bits = static_cast<double>(trellis->second.shape[2]) / 16.0;
    if (width_bits != m.bits_per_weight) {
      return bad(m, absl::StrCat("bits_per_weight ", m.bits_per_weight, ", but its trellis holds ",
                                 width_bits, " bits per weight"));
    }
    const bool has_mcg = m.tensors.count(key + ".mcg") > 0;
    const bool has_mul1 = m.tensors.count(key + ".mul1") > 0;
    if (has_mcg != (m.mcg_multiplier != 0) || has_mul1 != (m.mul1_multiplier != 0)) {
      return bad(m, "its codebook flag tensors and its recorded multipliers disagree");
    }
    if (has_mcg && m.mcg_multiplier != kMcgMultiplier) {
      return bad(m, absl::StrCat("mcg_multiplier ", m.mcg_multiplier, " is not MCG's ",
                                 kMcgMultiplier));
    }
    if (has_mul1 && m.mul1_multiplier != kMul1Multiplier) {
      return bad(m, absl::StrCat("mul1_multiplier ", m.mul1_multiplier, " is not MUL1's ",
                                 kMul1Multiplier));
    }
  }
  return absl::OkStatus();
}

}  // namespace exl3
