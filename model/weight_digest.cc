#include "model/weight_digest.h"

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "nlohmann/json.hpp"

namespace exl3 {
namespace {

constexpr uint64_t kP1 = 0x9e3779b185ebca87ull;
constexpr uint64_t kP2 = 0xc2b2ae3d27d4eb4full;

uint64_t Rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
uint64_t Round(uint64_t acc, uint64_t in) { return Rotl(acc + in * kP2, 31) * kP1; }
uint64_t Mix(uint64_t h) {
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP1;
  return h ^ (h >> 32);
}

}  // namespace

std::string DigestBytes(const uint8_t* data, size_t n) {
  uint64_t lane[4] = {kP1 + kP2, kP2, 0, 0 - kP1};
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int k = 0; k < 4; ++k) {
      uint64_t w;
      std::memcpy(&w, data + i + 8 * k, 8);
      lane[k] = Round(lane[k], w);
    }
  }
  uint64_t h = Rotl(lane[0], 1) + Rotl(lane[1], 7) + Rotl(lane[2], 12) + Rotl(lane[3], 18);
  h += static_cast<uint64_t>(n);
  for (; i < n; ++i) h = Round(h, data[i]);
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(Mix(h)));
  return hex;
}

absl::StatusOr<std::optional<WeightDigests>> ReadWeightDigests(
    const std::string& dir, const std::vector<std::string>& names) {
  namespace fs = std::filesystem;
  const fs::path path = fs::path(dir) / kWeightDigestFile;
  std::error_code ec;
  if (!fs::exists(path, ec)) return std::optional<WeightDigests>();
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  const nlohmann::json j = nlohmann::json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  const std::string where = path.string();
  if (j.is_discarded() || !j.is_object() || !j.contains("tensors") || !j["tensors"].is_object()) {
    return absl::DataLossError(absl::StrCat(where, ": not JSON with a \"tensors\" object"));
  }
  const std::string algo = j.value("algorithm", "");
  if (algo != kWeightDigestAlgorithm) {
    return absl::DataLossError(absl::StrCat(where, ": digest algorithm \"", algo, "\", expected \"",
                                            kWeightDigestAlgorithm, "\""));
  }
  WeightDigests d;
  for (auto it = j["tensors"].begin(); it != j["tensors"].end(); ++it) {
    if (!it.value().is_string()) {
      return absl::DataLossError(absl::StrCat(where, ": the digest of '", it.key(), "' is not a string"));
    }
    d[it.key()] = it.value().get<std::string>();
  }
  for (const std::string& n : names) {
    if (!d.count(n)) {
      return absl::DataLossError(absl::StrCat(where, " has no digest of tensor '", n,
                                              "': it was written for another directory"));
    }
  }
  if (d.size() != names.size()) {
    return absl::DataLossError(absl::StrCat(where, " lists ", d.size(), " tensors, the model has ",
                                            names.size(), ": it was written for another directory"));
  }
  return std::optional<WeightDigests>(std::move(d));
}

}  // namespace exl3
