// Content digests of a model directory's tensors: recorded once, when the directory is written
// (exl3-tool quantize, the test model writers), in weights.digest.json beside config.json, and
// checked when a tensor is first read (TensorSource::Get). The model fingerprint
// (model/exl3_model.h) covers them, so processes that serve different shares of the same
// directory agree on it and a directory with other weights differs, without any process reading
// tensors it does not load.
//
//   EXL3_RETURN_IF_ERROR(WriteWeightDigests(dir));  // model/write_weight_digests.h, after the shards
//   EXL3_ASSIGN_OR_RETURN(std::optional<WeightDigests> d, ReadWeightDigests(dir, names));
//
// weights.digest.json: {"algorithm": "exl3-wd1", "tensors": {"<name>": "<16 hex digits>", ...}}.
// The digest (exl3-wd1) is a 64-bit hash of the bytes over four interleaved 64-bit lanes (identity,
// not security: it tells weights apart, it does not resist a forger).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace exl3 {

inline constexpr char kWeightDigestFile[] = "weights.digest.json";
inline constexpr char kWeightDigestAlgorithm[] = "exl3-wd1";

using WeightDigests = std::map<std::string, std::string, std::less<>>;  // tensor -> hex digest

// 16 hex digits.
std::string DigestBytes(const uint8_t* data, size_t n);

// The digests recorded in `dir`, or nullopt when the directory has no weights.digest.json (a model
// written before digests were recorded). Error when the file does not parse, names another
// algorithm, or does not list exactly the tensors `names`.
absl::StatusOr<std::optional<WeightDigests>> ReadWeightDigests(const std::string& dir,
                                                               const std::vector<std::string>& names);

}  // namespace exl3
