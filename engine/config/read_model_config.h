// The engines' reader of a model directory's configuration: config.json, parsed once
// (model/config/config_file.h), read into a ModelConfig (engine/config/model_config.h) whose MoE layout
// comes from the same parse (model/config/read_moe_config.h), as transformers 5.x writes it
// (`rope_parameters`) and as older files do (`rope_theta`, `rope_scaling`,
// `partial_rotary_factor` at the top level).
//
//   absl::StatusOr<ModelConfig> cfg = LoadModelConfig("/models/glm-exl3");
//   cfg->attention == AttentionKind::kGqa;  cfg->rope.rotary_dim == 32;
//
// The fields every family shares are read here; each architecture's section reads the rest and
// sets the rope and the softmax scale (one line per architecture in read_model_config.cc):
//   Glm4MoeForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM  engine/config/gqa_section.h
//   DeepseekV3ForCausalLM, GlmMoeDsaForCausalLM                   engine/config/latent_section.h
//   DeepseekV4ForCausalLM                                         engine/config/dsv4_section.h
//   Qwen3NextForCausalLM                                          engine/config/qwen3next_section.h
//   Glm5NextForConditionalGeneration (its text model)             engine/config/glm5next_section.h
//   Qwen4ExpForConditionalGeneration (its text model)             engine/config/qwen4exp_section.h
#pragma once

#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "engine/config/model_config.h"
#include "model/config/config_file.h"

namespace exl3::engine {

// `generation_config_json`'s eos_token_id, when given, replaces config.json's.
absl::StatusOr<ModelConfig> ReadModelConfig(const ConfigFile& file,
                                            std::string_view generation_config_json = {});
// Parses config.json text (`source` names it in errors) and reads it.
absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view config_json, std::string_view source,
                                             std::string_view generation_config_json = {});
// Reads DIR/config.json (and DIR/generation_config.json when present).
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& dir);
// `file`: DIR/config.json as the caller read it (ConfigFile::Read(dir)), not read again; with
// DIR/generation_config.json when present. The engines read config.json once this way and hand the
// same ConfigFile to Exl3Model::Open (model/exl3_model.h) for the experts and the fingerprint.
absl::StatusOr<ModelConfig> LoadModelConfig(const ConfigFile& file, const std::string& dir);

}  // namespace exl3::engine
