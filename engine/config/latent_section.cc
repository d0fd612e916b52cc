#include "engine/config/latent_section.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/config/fields.h"

namespace exl3::engine {
namespace {

using nlohmann::json;

// The MLA shape (DeepSeek-V3 and GLM-MoE-DSA name it alike).
absl::Status ReadLatentShape(const json& j, const std::string& source, ModelConfig* cfg) {
  cfg->q_lora_rank = IntOr(j, "q_lora_rank", 0);
  EXL3_ASSIGN_OR_RETURN(cfg->kv_lora_rank, RequireInt(j, source, "kv_lora_rank"));
  EXL3_ASSIGN_OR_RETURN(cfg->qk_nope_head_dim, RequireInt(j, source, "qk_nope_head_dim"));
  EXL3_ASSIGN_OR_RETURN(cfg->qk_rope_head_dim, RequireInt(j, source, "qk_rope_head_dim"));
  EXL3_ASSIGN_OR_RETURN(cfg->v_head_dim, RequireInt(j, source, "v_head_dim"));
  if (cfg->q_lora_rank < 0 || cfg->kv_lora_rank <= 0 || cfg->qk_nope_head_dim < 0 ||
      cfg->qk_rope_head_dim <= 0 || cfg->v_head_dim <= 0)
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": q_lora_rank ", cfg->q_lora_rank, ", kv_lora_rank ", cfg->kv_lora_rank,
        ", qk_nope_head_dim ", cfg->qk_nope_head_dim, ", qk_rope_head_dim ",
        cfg->qk_rope_head_dim, ", v_head_dim ", cfg->v_head_dim, " are not a valid MLA shape"));
  return absl::OkStatus();
}

absl::Status ReadDsaIndexer(const json& j, const ModelConfig& cfg, const std::string& source,
                          IndexerConfig* ix) {
  // transformers' GlmMoeDsaConfig defaults when a file leaves them out.
  ix->num_heads = IntOr(j, "index_n_heads", 32);
  ix->head_dim = IntOr(j, "index_head_dim", 128);
  ix->topk = IntOr(j, "index_topk", 2048);
  if (ix->num_heads <= 0 || ix->topk <= 0 || ix->head_dim < cfg.qk_rope_head_dim)
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": indexer of ", ix->num_heads, " heads of ", ix->head_dim, " (index_topk ",
        ix->topk, "): needs heads > 0, top-k > 0 and index_head_dim >= qk_rope_head_dim ",
        cfg.qk_rope_head_dim));
  if (cfg.q_lora_rank <= 0)
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": GlmMoeDsaForCausalLM needs q_lora_rank > 0 (the indexer's queries start from "
                "the normalised q_a_proj output)"));
  EXL3_ASSIGN_OR_RETURN(ix->layer_modes, IndexerModes(j, cfg.num_layers, source));
  if (cfg.num_layers > 0 && ix->layer_modes[0] != IndexerMode::kFull)
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": layer 0 shares the top-k selection of an earlier layer, and there is none "
                "(its indexer type must be full)"));
  return absl::OkStatus();
}

// The rope over the rope head (interleaved pairs: DeepSeek-V3 follows rope_interleave, default
// true; GLM-MoE-DSA always interleaves, MLA and indexer alike) and the softmax scale:
// 1/sqrt(qk_nope_head_dim + qk_rope_head_dim), times mscale(factor, mscale_all_dim)^2 under a
// scaled rope as DeepSeek does.
absl::Status ReadLatentRope(const json& j, const std::string& source, double partial,
                            bool interleave, ModelConfig* cfg) {
  const json p = MergedRopeParameters(j);
  EXL3_RETURN_IF_ERROR(ParseRopeParameters(p, cfg->qk_rope_head_dim, partial,
                                           cfg->max_position_embeddings, source, &cfg->rope));
  cfg->rope.layout = interleave ? RopeLayout::kInterleaved : RopeLayout::kHalfSplit;
  double scale = 1.0 / std::sqrt(static_cast<double>(cfg->qk_nope_head_dim + cfg->qk_rope_head_dim));
  const double mscale_all_dim = NumberOr(p, "mscale_all_dim", 0.0);
  if (cfg->rope.type != RopeType::kDefault && mscale_all_dim != 0.0) {
    const double m = YarnMscale(NumberOr(p, "factor", 1.0), mscale_all_dim);
    scale *= m * m;
  }
  cfg->attention_scale = static_cast<float>(scale);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<IndexerMode>> IndexerModes(const json& j, int num_layers,
                                                      const std::string& source) {
  std::vector<IndexerMode> modes;
  auto bad = [&](const char* field, const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", field, " ", why));
  };
  auto add = [&](const std::string& v, const char* field) -> absl::Status {
    if (v == "full" || v == "F") {
      modes.push_back(IndexerMode::kFull);
    } else if (v == "shared" || v == "S") {
      modes.push_back(IndexerMode::kShared);
    } else {
      return bad(field, absl::StrCat("holds '", v, "' (full / shared, or F / S)"));
    }
    return absl::OkStatus();
  };
  const char* field = nullptr;
  if (j.contains("indexer_types") && !j["indexer_types"].is_null()) {
    field = "indexer_types";
  } else if (j.contains("index_topk_pattern") && !j["index_topk_pattern"].is_null()) {
    field = "index_topk_pattern";
  }
  if (field != nullptr) {
    const json& v = j[field];
    if (v.is_string()) {
      for (char c : v.get<std::string>()) EXL3_RETURN_IF_ERROR(add(std::string(1, c), field));
    } else if (v.is_array()) {
      for (const json& e : v) {
        if (!e.is_string()) return bad(field, "holds a non-string");
        EXL3_RETURN_IF_ERROR(add(e.get<std::string>(), field));
      }
    } else {
      return bad(field, "is neither a list nor a string");
    }
    if (static_cast<int>(modes.size()) < num_layers)
      return bad(field, absl::StrCat("names ", modes.size(), " layers of ", num_layers));
    modes.resize(num_layers);
  } else {
    const int freq = std::max(IntOr(j, "index_topk_freq", 1), 1);
    const int offset = IntOr(j, "index_skip_topk_offset", 2);
    for (int i = 0; i < num_layers; ++i)
      modes.push_back(std::max(i - offset + 1, 0) % freq == 0 ? IndexerMode::kFull
                                                              : IndexerMode::kShared);
  }
  return modes;
}

absl::Status ReadDeepseekV3Section(const ConfigFile& file, ModelConfig* cfg) {
  const json& j = file.text();
  cfg->attention = AttentionKind::kMla;
  EXL3_RETURN_IF_ERROR(ReadLatentShape(j, file.source(), cfg));
  const double partial = NumberOr(MergedRopeParameters(j), "partial_rotary_factor", 1.0);
  return ReadLatentRope(j, file.source(), partial, j.value("rope_interleave", true), cfg);
}

absl::Status ReadGlmMoeDsaSection(const ConfigFile& file, ModelConfig* cfg) {
  const json& j = file.text();
  cfg->attention = AttentionKind::kDsa;
  EXL3_RETURN_IF_ERROR(ReadLatentShape(j, file.source(), cfg));
  EXL3_RETURN_IF_ERROR(ReadDsaIndexer(j, *cfg, file.source(), &cfg->indexer));
  // GLM-MoE-DSA's rotary embedding covers its whole rope head (transformers points head_dim at
  // qk_rope_head_dim and reads no partial factor for it).
  return ReadLatentRope(j, file.source(), /*partial=*/1.0, /*interleave=*/true, cfg);
}

}  // namespace exl3::engine
