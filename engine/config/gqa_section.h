// The configuration sections of the GQA families, whose layers are all grouped-query attention
// (engine/cpu/attention/gqa_attention.h): GLM-4.x MoE (Glm4MoeForCausalLM), Qwen3-MoE and Mixtral. Each reads
// its attention options and rope and sets the softmax scale; the fields every family shares are
// read already (engine/config/read_model_config.h).
#pragma once

#include "absl/status/status.h"
#include "engine/config/model_config.h"
#include "model/config/config_file.h"

namespace exl3::engine {

absl::Status ReadGlm4MoeSection(const ConfigFile& file, ModelConfig* cfg);
absl::Status ReadQwen3MoeSection(const ConfigFile& file, ModelConfig* cfg);
absl::Status ReadMixtralSection(const ConfigFile& file, ModelConfig* cfg);

}  // namespace exl3::engine
