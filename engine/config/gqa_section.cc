#include "engine/config/gqa_section.h"

#include <cmath>

#include "base/status_macros.h"
#include "engine/config/fields.h"

namespace exl3::engine {
namespace {

// The rope over each head's leading head_dim * partial_rotary_factor dimensions, and the
// softmax scale 1/sqrt(head_dim).
absl::Status ReadGqaRope(const ConfigFile& file, double default_partial, ModelConfig* cfg) {
  EXL3_RETURN_IF_ERROR(ReadRope(file.text(), cfg->head_dim, default_partial,
                                cfg->max_position_embeddings, file.source(), &cfg->rope));
  cfg->attention_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(cfg->head_dim)));
  return absl::OkStatus();
}

}  // namespace

absl::Status ReadGlm4MoeSection(const ConfigFile& file, ModelConfig* cfg) {
  cfg->qk_norm = file.text().value("use_qk_norm", false);
  return ReadGqaRope(file, /*default_partial=*/0.5, cfg);  // Glm4MoeConfig's default
}

absl::Status ReadQwen3MoeSection(const ConfigFile& file, ModelConfig* cfg) {
  const nlohmann::json& j = file.text();
  cfg->qk_norm = true;
  if (j.value("use_sliding_window", false)) cfg->sliding_window = IntOr(j, "sliding_window", 0);
  return ReadGqaRope(file, /*default_partial=*/1.0, cfg);
}

absl::Status ReadMixtralSection(const ConfigFile& file, ModelConfig* cfg) {
  cfg->sliding_window = IntOr(file.text(), "sliding_window", 0);
  return ReadGqaRope(file, /*default_partial=*/1.0, cfg);
}

}  // namespace exl3::engine
