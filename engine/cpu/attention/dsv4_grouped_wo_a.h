// DeepSeek-V4's grouped output projection wo_a as one dense weight, from either layout it is
// stored in: one layer `PREFIX` [o_groups * o_lora_rank, in_per_group] (group g's rows
// g * o_lora_rank ..), or exllamav3's per-group slices `PREFIX.slice.G` (G = 0 .. o_groups - 1),
// each its own layer [o_lora_rank, in_per_group] holding those rows (exllamav3 quantizes and runs
// every group on its own). Either may be EXL3 or dense; the result is the same matrix.
//
//   EXL3_ASSIGN_OR_RETURN(std::vector<float> w,
//                         LoadGroupedWoA(src, "model.layers.0.attn.wo_a", G, R, in_per_group));
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/safetensors.h"

namespace exl3::engine {

// fp32 [o_groups * o_lora_rank, in_per_group]. Refused: both layouts at once, a slice missing
// or one beyond o_groups, a bias (DeepSeek-V4's wo_a has none, and the callers add none).
absl::StatusOr<std::vector<float>> LoadGroupedWoA(const TensorSource& src, const std::string& prefix,
                                                  int o_groups, int o_lora_rank, int in_per_group);

}  // namespace exl3::engine
