// The MoE section of DeepSeek-V4 (DeepseekV4ForCausalLM): every layer MoE, the first ones (or
// those mlp_layer_types names "hash_moe") routed by token id, sqrt-softplus scores, one shared
// expert.
#pragma once

#include "absl/status/status.h"
#include "model/config/json_fields.h"
#include "model/moe_config.h"

namespace exl3 {

// Fills c's experts, shared expert, MoE and hash-routed layers, routing and clamp from `r`.
absl::Status ReadDeepseekV4Moe(const FieldReader& r, MoeConfig* c);

}  // namespace exl3
