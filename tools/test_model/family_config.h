// The Hugging Face config.json of a generated family model (test_model_spec.h), one section per
// family in the field names of its transformers configuration class.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "model/moe_config.h"
#include "nlohmann/json.hpp"
#include "tools/test_model/test_model_spec.h"

namespace exl3 {

// The Hugging Face config.json of a resolved spec (no quantization_config).
nlohmann::json TestModelConfig(const TestModelSpec& resolved);

// The files a release checkpoint of the spec's family carries beside config.json (name, content):
// GLM-5.3-Flash's processor_config.json with release_layout; none otherwise.
std::vector<std::pair<std::string, nlohmann::json>> TestModelSideFiles(const TestModelSpec& resolved);

// TestModelConfig as the engine's config parser reads it.
absl::StatusOr<MoeConfig> ParsedConfig(const TestModelSpec& resolved);

}  // namespace exl3
