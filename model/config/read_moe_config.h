// The MoE layout of a model (model/moe_config.h) read from its config.json: the reader the router,
// the expert workers, the converter and the tools use, and the MoE half of the engines' reader
// (engine/config/read_model_config.h), both from one ConfigFile (model/config/config_file.h).
//
//   absl::StatusOr<MoeConfig> cfg = LoadMoeConfig("/models/GLM-4.5-Air-exl3");  // dir or file
//
// The fields common to every family are read here; each family's MoE section
// (model/config/grouped_sigmoid_moe.h, deepseek_v4_moe.h, softmax_moe.h) reads the rest, as
// transformers 5.x writes them (and as older files did where the two differ;
// tests/fixtures/layouts/ holds the layouts transformers 5.24 saves). Every field a family needs
// is required; a missing one is named in the error. quantization_config is not required.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "model/config/config_file.h"
#include "model/moe_config.h"

namespace exl3 {

absl::StatusOr<MoeConfig> ReadMoeConfig(const ConfigFile& file);

// config.json text (`source` only names the file in errors), parsed and read.
absl::StatusOr<MoeConfig> ParseMoeConfig(std::string_view json_text, std::string_view source);

// Reads `path` (a config.json file, or a directory holding one) and parses it.
absl::StatusOr<MoeConfig> LoadMoeConfig(const std::string& path);

}  // namespace exl3
