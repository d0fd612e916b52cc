// The MoE section of GLM-4.x (Glm4MoeForCausalLM), GLM-5 (GlmMoeDsaForCausalLM), GLM-5.3-Flash
// (Glm5NextForConditionalGeneration's text model) and DeepSeek-V3: sigmoid scores with a
// correction bias, grouped top-k, n_shared_experts fused into one shared MLP, dense first layers.
#pragma once

#include "absl/status/status.h"
#include "model/config/json_fields.h"
#include "model/moe_config.h"

namespace exl3 {

// Fills c's experts, shared expert, MoE layers and routing from `r` (the text config); c's
// architecture, hidden size, layer count, top-k and swiglu_limit are read already.
absl::Status ReadGroupedSigmoidMoe(const FieldReader& r, MoeConfig* c);

}  // namespace exl3
