#include "engine/config/qwen3next_section.h"

#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/config/fields.h"

namespace exl3::engine {

using nlohmann::json;

absl::Status ReadQwen3NextLayers(const json& j, const std::string& source, bool indexed,
                                 ModelConfig* cfg) {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", why));
  };
  cfg->layer_mixers.clear();
  if (j.contains("layer_types") && !j["layer_types"].is_null()) {
    const json& types = j["layer_types"];
    if (!types.is_array() || static_cast<int>(types.size()) != cfg->num_layers)
      return bad(absl::StrCat("layer_types must list the ", cfg->num_layers, " layers"));
    for (const json& t : types) {
      const std::string v = t.is_string() ? t.get<std::string>() : "";
      if (v == "linear_attention") {
        cfg->layer_mixers.push_back(TokenMixer::kLinearAttention);
      } else if (v == "full_attention" || (indexed && v == "indexed_attention")) {
        cfg->layer_mixers.push_back(TokenMixer::kAttention);
      } else {
        return bad(absl::StrCat("layer_types holds '", t.dump(), "' (linear_attention or ",
                                indexed ? "indexed_attention" : "full_attention", ")"));
      }
    }
  } else {
    const int interval = IntOr(j, "full_attention_interval", 4);
    if (interval < 1) return bad("full_attention_interval must be at least 1");
    for (int l = 0; l < cfg->num_layers; ++l)
      cfg->layer_mixers.push_back((l + 1) % interval != 0 ? TokenMixer::kLinearAttention
                                                          : TokenMixer::kAttention);
  }
  // Qwen3NextConfig's defaults when a file leaves them out.
  LinearAttentionConfig& la = cfg->linear_attention;
  la.num_key_heads = IntOr(j, "linear_num_key_heads", 16);
  la.num_value_heads = IntOr(j, "linear_num_value_heads", 32);
  la.key_head_dim = IntOr(j, "linear_key_head_dim", 128);
  la.value_head_dim = IntOr(j, "linear_value_head_dim", 128);
  la.conv_kernel = IntOr(j, "linear_conv_kernel_dim", 4);
  if (la.num_key_heads <= 0 || la.num_value_heads <= 0 || la.key_head_dim <= 0 ||
      la.value_head_dim <= 0 || la.conv_kernel < 1 || la.num_value_heads % la.num_key_heads != 0)
    return bad(absl::StrCat("linear attention of ", la.num_key_heads, " key heads of ",
                            la.key_head_dim, ", ", la.num_value_heads, " value heads of ",
                            la.value_head_dim, ", conv kernel ", la.conv_kernel,
                            ": needs positive sizes and value heads a multiple of key heads"));
  // Channel counts stay well inside int (2 * key_dim + 2 * value_dim is in_proj_qkvz's width).
  const int64_t widest = 2 * static_cast<int64_t>(la.num_key_heads) * la.key_head_dim +
                         2 * static_cast<int64_t>(la.num_value_heads) * la.value_head_dim;
  if (widest > (int64_t{1} << 24) || la.conv_kernel > 1024)
    return bad(absl::StrCat("linear attention projections of ", widest,
                            " outputs or a conv kernel of ", la.conv_kernel, " are not a real shape"));
  std::string act = "silu";  // Qwen3NextConfig's default
  if (j.contains("hidden_act"))
    act = j["hidden_act"].is_string() ? j["hidden_act"].get<std::string>() : j["hidden_act"].dump();
  if (act != "silu")
    return absl::UnimplementedError(
        absl::StrCat(source, ": hidden_act '", act, "' (Qwen3-Next runs with silu)"));
  return absl::OkStatus();
}

absl::Status ReadQwen3NextSection(const ConfigFile& file, ModelConfig* cfg) {
  cfg->qk_norm = true;
  cfg->attention_output_gate = true;
  cfg->norm_weights = NormWeightConvention::kOffsetFromOne;
  EXL3_RETURN_IF_ERROR(ReadQwen3NextLayers(file.text(), file.source(), /*indexed=*/false, cfg));
  // Qwen3NextConfig's default partial_rotary_factor when the file names none: 0.25.
  EXL3_RETURN_IF_ERROR(ReadRope(file.text(), cfg->head_dim, /*default_partial=*/0.25,
                                cfg->max_position_embeddings, file.source(), &cfg->rope));
  cfg->attention_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(cfg->head_dim)));
  return absl::OkStatus();
}

}  // namespace exl3::engine
