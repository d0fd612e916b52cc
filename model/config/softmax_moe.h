// The MoE sections of the softmax-routed families: Qwen3-MoE and Qwen3-Next (decoder_sparse_step,
// mlp_only_layers), Qwen4-Exp's text model (every layer MoE, a gated shared expert) and Mixtral
// (every layer MoE, top-k always renormalised).
#pragma once

#include "absl/status/status.h"
#include "model/config/json_fields.h"
#include "model/moe_config.h"

namespace exl3 {

// Each fills c's experts, shared expert, MoE layers and routing from `r` (the text config).
absl::Status ReadQwenMoe(const FieldReader& r, MoeConfig* c);  // Qwen3-MoE, Qwen3-Next
absl::Status ReadQwen4ExpMoe(const FieldReader& r, MoeConfig* c);
absl::Status ReadMixtralMoe(const FieldReader& r, MoeConfig* c);

}  // namespace exl3
