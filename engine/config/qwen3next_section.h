// The configuration section of Qwen3-Next (Qwen3NextForCausalLM): per layer, gated DeltaNet
// linear attention (engine/cpu/linear_attention/gated_deltanet.h) or gated GQA with zero-centred norm weights.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "engine/config/model_config.h"
#include "model/config/config_file.h"

namespace exl3::engine {

absl::Status ReadQwen3NextSection(const ConfigFile& file, ModelConfig* cfg);

// Qwen3NextConfig's layer_types ("linear_attention" / "full_attention" per layer; when absent,
// every full_attention_interval-th layer (default 4) is full attention) into cfg->layer_mixers,
// and its DeltaNet shape into cfg->linear_attention. Qwen4-Exp (`indexed`, its section
// engine/config/qwen4exp_section.h) names its attention layers "indexed_attention" (and reads
// "full_attention" as that).
absl::Status ReadQwen3NextLayers(const nlohmann::json& j, const std::string& source, bool indexed,
                                 ModelConfig* cfg);

}  // namespace exl3::engine
