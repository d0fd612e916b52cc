// The rotary position embedding a layer applies (RopeConfig) and how config.json gives it: one
// set of rope parameters as transformers 5.x writes them ({rope_type, rope_theta, factor,
// original_max_position_embeddings, attention_factor, mscale, beta_fast, ...}) for heads of
// `head_dim`, rotating head_dim * partial_rotary_factor dimensions. Shared by the families'
// configuration sections (engine/config/): one set per model, DeepSeek-V4's two ("main" and
// "compress", engine/config/dsv4_section.cc).
#pragma once

#include <string>

#include "absl/status/status.h"
#include "nlohmann/json_fwd.hpp"

namespace exl3::engine {

enum class RopeType { kDefault, kLinear, kDynamic, kYarn };

// How the rotary dimensions pair up.
enum class RopeLayout {
  kHalfSplit,    // dimension i pairs with i + rotary_dim/2 (transformers' rotate_half)
  kInterleaved,  // dimension 2i pairs with 2i+1; the output is de-interleaved (DeepSeek)
};

struct RopeConfig {
  RopeType type = RopeType::kDefault;
  RopeLayout layout = RopeLayout::kHalfSplit;
  double theta = 10000.0;
  int rotary_dim = 0;  // leading dimensions of each head that rotate (even)
  double factor = 1.0;  // linear / dynamic / yarn
  int original_max_position = 0;  // yarn (and the dynamic threshold: max_position_embeddings)
  // yarn: scale of cos/sin (attention_factor given, or from factor, mscale, mscale_all_dim).
  double attention_factor = 1.0;
  double beta_fast = 32.0, beta_slow = 1.0;
  bool truncate = true;
};

absl::Status ParseRopeParameters(const nlohmann::json& params, int head_dim,
                                 double partial_rotary_factor, int max_position_embeddings,
                                 const std::string& source, RopeConfig* rope);

// A model's one set of rope parameters: transformers 5.x writes `rope_parameters` {rope_type,
// rope_theta, ...}; older files write `rope_theta` and `partial_rotary_factor` at the top level
// and the scaling in `rope_scaling` {type or rope_type, factor, ...}. Fields in the newer place
// win.
nlohmann::json MergedRopeParameters(const nlohmann::json& config);

// YaRN's magnitude correction: 0.1 * m * ln(scale) + 1 for scale > 1.
double YarnMscale(double scale, double m);

}  // namespace exl3::engine
