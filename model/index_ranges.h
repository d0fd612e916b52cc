// Index sets written as ranges ("0-7,12,20-23"): expert and layer lists in flags, expert maps,
// messages and `exl3-tool inspect`.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace exl3 {

// Parses "0-7,12,20-23" into sorted unique indices, each in [0, limit). "all" = [0, limit).
absl::StatusOr<std::vector<int32_t>> ParseIndexRanges(std::string_view text, int limit);
// The inverse: sorted indices as "0-7,12,20-23".
std::string FormatIndexRanges(const std::vector<int32_t>& sorted);

}  // namespace exl3
