#include "engine/config/fields.h"

#include <tuple>

#include "absl/strings/str_cat.h"

namespace exl3::engine {

using nlohmann::json;

absl::Status MissingField(const std::string& source, const std::string& field) {
  return absl::InvalidArgumentError(
      absl::StrCat(source, ": required field '", field, "' is missing or not a number"));
}

absl::StatusOr<int> RequireInt(const json& j, const std::string& source, const char* field) {
  auto it = j.find(field);
  if (it == j.end() || !it->is_number_integer()) return MissingField(source, field);
  return it->get<int>();
}

int IntOr(const json& j, const char* field, int fallback) {
  auto it = j.find(field);
  return it != j.end() && it->is_number_integer() ? it->get<int>() : fallback;
}

double NumberOr(const json& j, const char* field, double fallback) {
  auto it = j.find(field);
  return it != j.end() && it->is_number() ? it->get<double>() : fallback;
}

absl::StatusOr<std::vector<MediaPlaceholder>> ReadMediaPlaceholders(const json& top, int image_default,
                                                                    int video_default, int vocab_size,
                                                                    const std::string& source) {
  std::vector<MediaPlaceholder> out;
  for (const auto& [field, kind, fallback] : {std::tuple{"image_token_id", "image", image_default},
                                              std::tuple{"video_token_id", "video", video_default}}) {
    int id = fallback;
    auto it = top.find(field);
    if (it != top.end() && !it->is_null()) {
      if (!it->is_number_integer()) return absl::InvalidArgumentError(absl::StrCat(source, ": ", field, " is not an integer"));
      id = it->get<int>();
    }
    // One outside the vocabulary (tiny test models keep the release ids) can never reach the model.
    if (id >= 0 && id < vocab_size) out.push_back({id, kind});
  }
  return out;
}

absl::Status ReadRope(const json& text, int head_dim, double default_partial,
                      int max_position_embeddings, const std::string& source, RopeConfig* rope) {
  const json p = MergedRopeParameters(text);
  return ParseRopeParameters(p, head_dim, NumberOr(p, "partial_rotary_factor", default_partial),
                             max_position_embeddings, source, rope);
}

}  // namespace exl3::engine
