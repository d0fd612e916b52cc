#include "engine/model_config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/sequence_state.h"
#include "engine/dsv4_config.h"
#include "engine/glm5next_config.h"
#include "engine/qwen4exp_config.h"
#include "engine/rope_parameters.h"
#include "nlohmann/json.hpp"

namespace exl3::engine {
namespace {

using nlohmann::json;

absl::Status Missing(const std::string& source, const std::string& field) {
  return absl::InvalidArgumentError(
      absl::StrCat(source, ": required field '", field, "' is missing or not a number"));
}

absl::StatusOr<int> RequireInt(const json& j, const std::string& source, const char* field) {
  auto it = j.find(field);
  if (it == j.end() || !it->is_number_integer()) return Missing(source, field);
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

// YaRN's magnitude correction: 0.1 * m * ln(scale) + 1 for scale > 1.
double YarnMscale(double scale, double m) { return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; }

// The rope parameters: transformers 5.x writes `rope_parameters` {rope_type, rope_theta, ...};
// older files write `rope_theta` and `partial_rotary_factor` at the top level and the scaling in
// `rope_scaling` {type or rope_type, factor, ...}. Fields in the newer place win.
json MergedRopeParameters(const json& j) {
  json p = json::object();
  for (const char* k : {"rope_theta", "partial_rotary_factor"})
    if (j.contains(k) && !j[k].is_null()) p[k] = j[k];
  if (j.contains("rope_scaling") && j["rope_scaling"].is_object()) p.update(j["rope_scaling"]);
  if (j.contains("rope_parameters") && j["rope_parameters"].is_object())
    p.update(j["rope_parameters"]);
  if (!p.contains("rope_type") && p.contains("type")) p["rope_type"] = p["type"];
  return p;
}

absl::Status ParseRope(const json& j, const ModelConfig& cfg, const std::string& source,
                       double default_partial, RopeConfig* rope) {
  const json p = MergedRopeParameters(j);
  // The rotating part of a head: DeepSeek's rope head; else head_dim * partial_rotary_factor.
  // GLM-MoE-DSA's rotary embedding covers its whole rope head (transformers points head_dim at
  // qk_rope_head_dim and reads no partial factor for it).
  const int head = cfg.IsLatentAttention() ? cfg.qk_rope_head_dim : cfg.head_dim;
  const double partial = cfg.attention == AttentionKind::kDsa
                             ? 1.0
                             : NumberOr(p, "partial_rotary_factor", default_partial);
  return ParseRopeParameters(p, head, partial, cfg.max_position_embeddings, source, rope);
}

absl::StatusOr<std::vector<int32_t>> EosIds(const json& j) {
  std::vector<int32_t> ids;
  auto it = j.find("eos_token_id");
  if (it == j.end() || it->is_null()) return ids;
  if (it->is_number_integer()) {
    ids.push_back(it->get<int32_t>());
  } else if (it->is_array()) {
    for (const json& v : *it)
      if (v.is_number_integer()) ids.push_back(v.get<int32_t>());
  }
  return ids;
}

// The MLA shape (DeepSeek-V3 and GLM-MoE-DSA name it alike).
absl::Status ParseLatentAttention(const json& j, const std::string& source, ModelConfig* cfg) {
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

}  // namespace

// Which layers run their own indexer, as GlmMoeDsaConfig decides it: `indexer_types` ("full" /
// "shared" per layer) when given; else `index_topk_pattern` (a string of F / S, or such a list);
// else layer i is full when max(i - index_skip_topk_offset + 1, 0) is a multiple of
// index_topk_freq (defaults 2 and 1: every layer full).
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

namespace {

absl::Status ParseIndexer(const json& j, const ModelConfig& cfg, const std::string& source,
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

// Qwen3NextConfig's layer_types ("linear_attention" / "full_attention" per layer; when absent,
// every full_attention_interval-th layer (default 4) is full attention) and its DeltaNet shape.
// Qwen4-Exp (`indexed`) names its attention layers "indexed_attention" (and reads
// "full_attention" as that).
absl::Status ParseQwen3NextLayers(const json& j, const std::string& source, ModelConfig* cfg,
                                  bool indexed = false) {
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

}  // namespace

absl::Status ParseRopeParameters(const json& p, int head, double partial,
                                 int max_position_embeddings, const std::string& source,
                                 RopeConfig* rope) {
  rope->theta = NumberOr(p, "rope_theta", 10000.0);
  const std::string type = p.value("rope_type", std::string("default"));
  if (type == "default") {
    rope->type = RopeType::kDefault;
  } else if (type == "linear") {
    rope->type = RopeType::kLinear;
  } else if (type == "dynamic") {
    rope->type = RopeType::kDynamic;
  } else if (type == "yarn") {
    rope->type = RopeType::kYarn;
  } else {
    return absl::UnimplementedError(absl::StrCat(
        source, ": rope type '", type, "' is not supported (default, linear, dynamic, yarn)"));
  }
  rope->rotary_dim = static_cast<int>(head * partial);
  if (rope->rotary_dim <= 0 || rope->rotary_dim % 2 != 0 || rope->rotary_dim > head)
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": rotary dimension ", rope->rotary_dim, " of a head of ", head,
                     " (partial_rotary_factor ", partial, ") must be even and in (0, head]"));
  if (rope->type == RopeType::kDefault) return absl::OkStatus();

  rope->factor = NumberOr(p, "factor", 0.0);
  if (rope->type != RopeType::kYarn && rope->factor <= 0.0) return Missing(source, "rope factor");
  if (rope->type == RopeType::kYarn) {
    rope->original_max_position = IntOr(p, "original_max_position_embeddings", 0);
    if (rope->original_max_position <= 0)
      return Missing(source, "rope original_max_position_embeddings");
    if (rope->factor <= 0.0)
      rope->factor = static_cast<double>(max_position_embeddings) / rope->original_max_position;
    const double mscale = NumberOr(p, "mscale", 0.0);
    const double mscale_all_dim = NumberOr(p, "mscale_all_dim", 0.0);
    if (p.contains("attention_factor") && p["attention_factor"].is_number()) {
      rope->attention_factor = p["attention_factor"].get<double>();
    } else if (mscale != 0.0 && mscale_all_dim != 0.0) {
      rope->attention_factor =
          YarnMscale(rope->factor, mscale) / YarnMscale(rope->factor, mscale_all_dim);
    } else {
      rope->attention_factor = YarnMscale(rope->factor, 1.0);
    }
    // transformers treats 0 / null like absent here.
    if (NumberOr(p, "beta_fast", 0.0) != 0.0) rope->beta_fast = p["beta_fast"].get<double>();
    if (NumberOr(p, "beta_slow", 0.0) != 0.0) rope->beta_slow = p["beta_slow"].get<double>();
    if (p.contains("truncate") && p["truncate"].is_boolean()) rope->truncate = p["truncate"];
  }
  rope->original_max_position =
      rope->original_max_position > 0 ? rope->original_max_position : max_position_embeddings;
  return absl::OkStatus();
}

bool ModelConfig::HasRecurrentLayers() const {
  return std::find(layer_mixers.begin(), layer_mixers.end(), TokenMixer::kLinearAttention) !=
         layer_mixers.end();
}

int64_t ModelConfig::StateFloats(int layer) const {
  if (!IsLinearAttentionLayer(layer)) return 0;
  int64_t n = linear_attention.ConvStateFloats() + linear_attention.RecurrentStateFloats();
  if (qwen4exp != nullptr && qwen4exp->ple.PleIndex(layer) >= 0) n += qwen4exp->PleStateFloats(hidden_size);
  return n;
}

int64_t ModelConfig::StateFloatsPerSequence() const {
  int64_t n = 0;
  for (int l = 0; l < num_layers; ++l) n += StateFloats(l);
  return n;
}

int ModelConfig::KvWidth(int layer) const {
  if (IsLinearAttentionLayer(layer)) return 0;
  // GLM-5.3-Flash: the latent, then on full indexer layers the indexer key and pool gate score.
  if (attention == AttentionKind::kPooledDsa)
    return kv_lora_rank + (HasOwnIndexer(layer) ? 2 * indexer.head_dim : 0);
  if (attention == AttentionKind::kDsv4) return CacheLayoutFor(*dsv4, dsv4->layer_types[layer], 1).token_width;
  if (attention == AttentionKind::kQsa) return 2 * num_kv_heads * head_dim + qwen4exp->indexer.head_dim;
  if (!IsLatentAttention()) return 2 * num_kv_heads * head_dim;
  return kv_lora_rank + qk_rope_head_dim + (HasOwnIndexer(layer) ? indexer.head_dim : 0);
}

int ModelConfig::KvBlockFloats(int layer, int block_size) const {
  if (attention != AttentionKind::kDsv4) return 0;
  return CacheLayoutFor(*dsv4, dsv4->layer_types[layer], block_size).block_width;
}

int64_t ModelConfig::KvFloatsPerToken(int block_size) const {
  int64_t per_block = 0;
  for (int l = 0; l < num_layers; ++l)
    per_block += static_cast<int64_t>(block_size) * KvWidth(l) + KvBlockFloats(l, block_size);
  return (per_block + block_size - 1) / block_size;
}

absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view config_json,
                                             std::string_view source_name,
                                             std::string_view generation_config_json) {
  const std::string source(source_name);
  ModelConfig cfg;
  EXL3_ASSIGN_OR_RETURN(cfg.moe, ParseMoeConfig(config_json, source));
  // *ForConditionalGeneration: the text config's fields (model/moe_config.h LiftTextConfig), and
  // the top level's (Qwen4-Exp's image and video token ids).
  const json top = json::parse(config_json, nullptr, /*allow_exceptions=*/false);
  const json j = json::parse(LiftTextConfig(config_json), nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(source, ": not a JSON object"));

  cfg.hidden_size = cfg.moe.hidden_size;
  cfg.num_layers = cfg.moe.num_hidden_layers;
  cfg.layer_mixers.assign(cfg.num_layers, TokenMixer::kAttention);
  EXL3_ASSIGN_OR_RETURN(cfg.vocab_size, RequireInt(j, source, "vocab_size"));
  EXL3_ASSIGN_OR_RETURN(cfg.num_heads, RequireInt(j, source, "num_attention_heads"));
  EXL3_ASSIGN_OR_RETURN(cfg.max_position_embeddings,
                        RequireInt(j, source, "max_position_embeddings"));
  cfg.num_kv_heads = IntOr(j, "num_key_value_heads", cfg.num_heads);
  cfg.head_dim = IntOr(j, "head_dim", 0);
  if (cfg.head_dim <= 0 && cfg.num_heads > 0) cfg.head_dim = cfg.hidden_size / cfg.num_heads;
  cfg.intermediate_size = IntOr(j, "intermediate_size", 0);
  cfg.rms_norm_eps = static_cast<float>(NumberOr(j, "rms_norm_eps", 1e-6));
  cfg.tie_word_embeddings = j.value("tie_word_embeddings", false);
  if (cfg.num_heads <= 0 || cfg.num_kv_heads <= 0 || cfg.num_heads % cfg.num_kv_heads != 0)
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", cfg.num_heads, " heads cannot be grouped over ",
                                                   cfg.num_kv_heads, " KV heads"));

  double default_partial = 1.0;
  switch (cfg.moe.family) {
    case MoeFamily::kGlm:
      if (cfg.architecture() == "Glm5NextForConditionalGeneration") {
        EXL3_RETURN_IF_ERROR(ParseGlm5NextConfig(j, source, &cfg));
        break;
      }
      if (cfg.architecture() == "GlmMoeDsaForCausalLM") {
        cfg.attention = AttentionKind::kDsa;
        EXL3_RETURN_IF_ERROR(ParseLatentAttention(j, source, &cfg));
        EXL3_RETURN_IF_ERROR(ParseIndexer(j, cfg, source, &cfg.indexer));
        break;
      }
      cfg.qk_norm = j.value("use_qk_norm", false);
      default_partial = 0.5;  // Glm4MoeConfig's default when the file names none
      break;
    case MoeFamily::kQwen3Moe:
      cfg.qk_norm = true;
      if (j.value("use_sliding_window", false)) cfg.sliding_window = IntOr(j, "sliding_window", 0);
      break;
    case MoeFamily::kMixtral:
      cfg.sliding_window = IntOr(j, "sliding_window", 0);
      break;
    case MoeFamily::kQwen3Next:
      cfg.qk_norm = true;
      cfg.attention_output_gate = true;
      cfg.norm_weights = NormWeightConvention::kOffsetFromOne;
      default_partial = 0.25;  // Qwen3NextConfig's default when the file names none
      EXL3_RETURN_IF_ERROR(ParseQwen3NextLayers(j, source, &cfg));
      break;
    case MoeFamily::kQwen4Exp:
      cfg.qk_norm = true;
      cfg.attention_output_gate = true;
      cfg.norm_weights = NormWeightConvention::kOffsetFromOne;
      cfg.attention = AttentionKind::kQsa;
      default_partial = 1.0;  // Qwen4ExpTextConfig skips Qwen3.5's 0.25 default
      EXL3_RETURN_IF_ERROR(ParseQwen3NextLayers(j, source, &cfg, /*indexed=*/true));
      EXL3_RETURN_IF_ERROR(ParseQwen4ExpConfig(j, top, source, &cfg));
      break;
    case MoeFamily::kDeepseekV3:
      cfg.attention = AttentionKind::kMla;
      EXL3_RETURN_IF_ERROR(ParseLatentAttention(j, source, &cfg));
      break;
    case MoeFamily::kDeepseekV4:
      cfg.attention = AttentionKind::kDsv4;
      EXL3_RETURN_IF_ERROR(ParseDsv4Config(j, source, &cfg));
      break;
    default:
      break;
  }
  if (cfg.attention == AttentionKind::kDsv4) {
    cfg.rope = cfg.dsv4->main_rope;  // per layer type: engine/dsv4_config.h
  } else if (cfg.attention == AttentionKind::kPooledDsa) {
    cfg.rope = RopeConfig{};  // NoPE: nothing rotates (rotary_dim 0)
    cfg.rope.rotary_dim = 0;
  } else {
    EXL3_RETURN_IF_ERROR(ParseRope(j, cfg, source, default_partial, &cfg.rope));
  }
  if (cfg.attention == AttentionKind::kQsa && cfg.rope.rotary_dim > cfg.qwen4exp->indexer.head_dim &&
      cfg.qwen4exp->indexer.head_dim > 0)
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": the rotary dimensions (", cfg.rope.rotary_dim,
        ") must fit the QSA index head (indexer_head_dim ", cfg.qwen4exp->indexer.head_dim, ")"));
  if (cfg.attention == AttentionKind::kDsv4) {
    cfg.attention_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(cfg.head_dim)));
  } else if (cfg.attention == AttentionKind::kPooledDsa) {
    cfg.attention_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(cfg.qk_nope_head_dim)));
  } else if (cfg.IsLatentAttention()) {
    // DeepSeek-V3 follows rope_interleave (default true); GLM-MoE-DSA always interleaves (MLA
    // and indexer alike).
    const bool interleave =
        cfg.attention == AttentionKind::kDsa || j.value("rope_interleave", true);
    cfg.rope.layout = interleave ? RopeLayout::kInterleaved : RopeLayout::kHalfSplit;
    // DeepSeek scales the softmax by mscale(factor, mscale_all_dim)^2 under a scaled rope.
    double scale = 1.0 / std::sqrt(static_cast<double>(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim));
    const json p = MergedRopeParameters(j);
    const double mscale_all_dim = NumberOr(p, "mscale_all_dim", 0.0);
    if (cfg.rope.type != RopeType::kDefault && mscale_all_dim != 0.0) {
      const double m = YarnMscale(NumberOr(p, "factor", 1.0), mscale_all_dim);
      scale *= m * m;
    }
    cfg.attention_scale = static_cast<float>(scale);
  } else {
    cfg.attention_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(cfg.head_dim)));
  }
  if (cfg.num_layers > 0 && cfg.intermediate_size <= 0) {
    for (int l = 0; l < cfg.num_layers; ++l)
      if (!cfg.IsMoeLayer(l)) return Missing(source, "intermediate_size (a dense MLP layer exists)");
  }

  EXL3_ASSIGN_OR_RETURN(cfg.eos_token_ids, EosIds(j));
  if (!generation_config_json.empty()) {
    const json g = json::parse(generation_config_json, nullptr, false);
    if (g.is_object() && g.contains("eos_token_id")) {
      EXL3_ASSIGN_OR_RETURN(cfg.eos_token_ids, EosIds(g));
    }
  }
  return cfg;
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& dir) {
  auto read = [](const std::string& path, std::string* out) {
    std::ifstream f(path);
    if (!f) return false;
    std::stringstream ss;
    ss << f.rdbuf();
    *out = ss.str();
    return true;
  };
  std::string config, generation;
  const std::string path = dir + "/config.json";
  if (!read(path, &config)) return absl::NotFoundError(absl::StrCat(path, ": cannot be read"));
  read(dir + "/generation_config.json", &generation);
  return ParseModelConfig(config, path, generation);
}

ModelInfo ModelInfoFor(const ModelConfig& cfg, const std::string& dir, const std::string& served_name) {
  ModelInfo info;
  info.name = served_name.empty() ? std::filesystem::path(dir).lexically_normal().filename().string() : served_name;
  if (info.name.empty()) info.name = std::filesystem::path(dir).parent_path().filename().string();
  info.architecture = cfg.architecture();
  info.vocab_size = cfg.vocab_size;
  info.max_context = cfg.max_position_embeddings;
  info.eos_token_ids = cfg.eos_token_ids;
  info.kv_bytes_per_token = cfg.KvFloatsPerToken() * static_cast<int64_t>(sizeof(float));
  info.state_bytes_per_sequence = SequenceStateStore::kCopies * cfg.StateFloatsPerSequence() *
                                  static_cast<int64_t>(sizeof(float));
  return info;
}

}  // namespace exl3::engine
