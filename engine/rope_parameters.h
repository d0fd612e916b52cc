// One set of rope parameters as transformers 5.x writes them ({rope_type, rope_theta, factor,
// original_max_position_embeddings, attention_factor, mscale, beta_fast, ...}) for heads of
// `head_dim`, rotating head_dim * partial_rotary_factor dimensions. Shared by the families'
// configuration readers: engine/model_config.cc (one set per model) and engine/dsv4_config.cc
// (DeepSeek-V4's two, "main" and "compress").
#pragma once

#include <string>

#include "absl/status/status.h"
#include "engine/model_config.h"
#include "nlohmann/json_fwd.hpp"

namespace exl3::engine {

absl::Status ParseRopeParameters(const nlohmann::json& params, int head_dim,
                                 double partial_rotary_factor, int max_position_embeddings,
                                 const std::string& source, RopeConfig* rope);

}  // namespace exl3::engine
