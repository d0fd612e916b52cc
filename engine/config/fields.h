// Field readers shared by the engine's configuration sections (engine/config/*_section.h), with
// the transformers default in hand where a file may leave a field out, and the model's one set of
// rope parameters.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/config/rope_parameters.h"
#include "engine/core/model_runner.h"
#include "nlohmann/json.hpp"

namespace exl3::engine {

// INVALID_ARGUMENT: "SOURCE: required field 'FIELD' is missing or not a number".
absl::Status MissingField(const std::string& source, const std::string& field);
// An integer field that must be present.
absl::StatusOr<int> RequireInt(const nlohmann::json& j, const std::string& source, const char* field);
// An integer (a number) field, or `fallback` when absent or of another type.
int IntOr(const nlohmann::json& j, const char* field, int fallback);
double NumberOr(const nlohmann::json& j, const char* field, double fallback);

// A multimodal checkpoint's image and video placeholders: config.json's top-level image_token_id
// and video_token_id (the defaults when absent or null); those outside the vocabulary are left out.
absl::StatusOr<std::vector<MediaPlaceholder>> ReadMediaPlaceholders(const nlohmann::json& top, int image_default,
                                                                    int video_default, int vocab_size,
                                                                    const std::string& source);

// The text config's rope (engine/config/rope_parameters.h MergedRopeParameters) for heads of `head_dim`,
// rotating head_dim * partial_rotary_factor dimensions (`default_partial` when the file names
// no factor).
absl::Status ReadRope(const nlohmann::json& text, int head_dim, double default_partial,
                      int max_position_embeddings, const std::string& source, RopeConfig* rope);

}  // namespace exl3::engine
