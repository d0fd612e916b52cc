#include "engine/config/glm5next_section.h"

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/config/fields.h"
#include "engine/config/latent_section.h"
#include "engine/config/glm5next_config.h"

namespace exl3::engine {
namespace {

using nlohmann::json;

constexpr char kLinear[] = "linear_attention";
constexpr char kIndexed[] = "indexed_attention";
// exllamav3 reads GLM-5.3's MLA layers only under this name (architecture/glm5_next.py of its
// wheel; GLM-MoE-DSA's transformers config writes it too): the same layer.
constexpr char kDeepseekSparse[] = "deepseek_sparse_attention";

absl::Status Bad(const std::string& source, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(source, ": ", what));
}

// An integer field, or `fallback` (Glm5NextTextConfig's default) when absent or null.
absl::StatusOr<int> IntField(const json& j, const char* field, int fallback, const std::string& source) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_number_integer()) return Bad(source, absl::StrCat(field, " is not an integer"));
  const int64_t v = it->get<int64_t>();
  if (v < 0 || v > (int64_t{1} << 24)) return Bad(source, absl::StrCat(field, " is out of range: ", v));
  return static_cast<int>(v);
}

double NumberField(const json& j, const char* field, double fallback) {
  auto it = j.find(field);
  return it != j.end() && it->is_number() ? it->get<double>() : fallback;
}

absl::Status ParseLayerTypes(const json& j, const std::string& source, ModelConfig* cfg) {
  cfg->layer_mixers.clear();
  auto it = j.find("layer_types");
  if (it == j.end() || it->is_null()) {
    for (int l = 0; l < cfg->num_layers; ++l)
      cfg->layer_mixers.push_back(l % 4 != 3 ? TokenMixer::kLinearAttention : TokenMixer::kAttention);
    return absl::OkStatus();
  }
  if (!it->is_array() || static_cast<int>(it->size()) != cfg->num_layers)
    return Bad(source, absl::StrCat("layer_types must list the ", cfg->num_layers, " layers"));
  for (const json& t : *it) {
    const std::string v = t.is_string() ? t.get<std::string>() : "";
    if (v == kLinear) {
      cfg->layer_mixers.push_back(TokenMixer::kLinearAttention);
    } else if (v == kIndexed || v == "full_attention" || v == kDeepseekSparse) {
      cfg->layer_mixers.push_back(TokenMixer::kAttention);
    } else {
      return Bad(source, absl::StrCat("layer_types holds ", t.dump(), " (", kLinear, " or ", kIndexed, ")"));
    }
  }
  return absl::OkStatus();
}

// KDA's shape: linear_num_heads × linear_head_dim for q, k and v alike, linear_conv_kernel_dim
// taps; a `linear_attn_config` dict overrides the flat fields as Glm5NextTextConfig reads it.
absl::Status ParseKda(const json& j, const std::string& source, ModelConfig* cfg, Glm5NextConfig* g) {
  EXL3_ASSIGN_OR_RETURN(int heads, IntField(j, "linear_num_heads", 64, source));
  EXL3_ASSIGN_OR_RETURN(int head_dim, IntField(j, "linear_head_dim", 128, source));
  EXL3_ASSIGN_OR_RETURN(int kernel, IntField(j, "linear_conv_kernel_dim", 4, source));
  g->gate_lower_bound = -5.0f;
  if (j.contains("linear_lower_bound")) {
    const json& b = j["linear_lower_bound"];
    if (b.is_null()) {
      g->gate_lower_bound.reset();
    } else if (b.is_number()) {
      g->gate_lower_bound = b.get<float>();
    } else {
      return Bad(source, "linear_lower_bound is neither a number nor null");
    }
  }
  if (j.contains("linear_attn_config") && j["linear_attn_config"].is_object()) {
    const json& d = j["linear_attn_config"];
    EXL3_ASSIGN_OR_RETURN(head_dim, IntField(d, "head_dim", head_dim, source));
    EXL3_ASSIGN_OR_RETURN(heads, IntField(d, "num_heads", heads, source));
    EXL3_ASSIGN_OR_RETURN(kernel, IntField(d, "short_conv_kernel_size", kernel, source));
    if (d.contains("gate_lower_bound")) {
      if (d["gate_lower_bound"].is_null()) {
        g->gate_lower_bound.reset();
      } else if (d["gate_lower_bound"].is_number()) {
        g->gate_lower_bound = d["gate_lower_bound"].get<float>();
      }
    }
    const bool safe_gate = !d.contains("safe_gate") || !d["safe_gate"].is_boolean() || d["safe_gate"].get<bool>();
    if (safe_gate && !g->gate_lower_bound) g->gate_lower_bound = -5.0f;
  }
  if (heads <= 0 || head_dim <= 0 || kernel < 1 || kernel > 64 ||
      static_cast<int64_t>(heads) * head_dim > (int64_t{1} << 20))
    return Bad(source, absl::StrCat("KDA of ", heads, " heads of ", head_dim, ", conv kernel ", kernel,
                                    " is not a valid shape"));
  LinearAttentionConfig& la = cfg->linear_attention;
  la.num_key_heads = la.num_value_heads = heads;
  la.key_head_dim = la.value_head_dim = head_dim;
  la.conv_kernel = kernel;
  return absl::OkStatus();
}

// NoPE MLA and the k-pooled indexer.
absl::Status ParseIndexedAttention(const json& j, const std::string& source, ModelConfig* cfg,
                                   Glm5NextConfig* g) {
  if (cfg->num_kv_heads != cfg->num_heads)
    return Bad(source, absl::StrCat("num_key_value_heads (", cfg->num_kv_heads,
                                    ") must equal num_attention_heads (", cfg->num_heads, ")"));
  if (!j.contains("q_lora_rank") || j["q_lora_rank"].is_null())
    return Bad(source, "q_lora_rank is required (the indexer's queries start from the q_a_proj output)");
  EXL3_ASSIGN_OR_RETURN(cfg->q_lora_rank, IntField(j, "q_lora_rank", 1536, source));
  EXL3_ASSIGN_OR_RETURN(cfg->kv_lora_rank, IntField(j, "kv_lora_rank", 512, source));
  EXL3_ASSIGN_OR_RETURN(cfg->qk_nope_head_dim, IntField(j, "qk_nope_head_dim", 256, source));
  EXL3_ASSIGN_OR_RETURN(cfg->qk_rope_head_dim, IntField(j, "qk_rope_head_dim", 0, source));
  EXL3_ASSIGN_OR_RETURN(cfg->v_head_dim, IntField(j, "v_head_dim", 256, source));
  if (cfg->qk_rope_head_dim != 0)
    return absl::UnimplementedError(absl::StrCat(
        source, ": qk_rope_head_dim ", cfg->qk_rope_head_dim,
        ": Glm5NextForConditionalGeneration's attention is NoPE (transformers requires 0)"));
  if (cfg->q_lora_rank <= 0 || cfg->kv_lora_rank <= 0 || cfg->qk_nope_head_dim <= 0 || cfg->v_head_dim <= 0)
    return Bad(source, absl::StrCat("q_lora_rank ", cfg->q_lora_rank, ", kv_lora_rank ", cfg->kv_lora_rank,
                                    ", qk_nope_head_dim ", cfg->qk_nope_head_dim, ", v_head_dim ",
                                    cfg->v_head_dim, " are not a valid MLA shape"));
  IndexerConfig& ix = cfg->indexer;
  EXL3_ASSIGN_OR_RETURN(ix.num_heads, IntField(j, "index_n_heads", 32, source));
  EXL3_ASSIGN_OR_RETURN(ix.head_dim, IntField(j, "index_head_dim", 128, source));
  EXL3_ASSIGN_OR_RETURN(ix.topk, IntField(j, "index_topk", 2048, source));
  EXL3_ASSIGN_OR_RETURN(g->index_kpool, IntField(j, "index_kpool", 16, source));
  if (ix.num_heads <= 0 || ix.head_dim <= 0 || ix.topk <= 0 || g->index_kpool < 1)
    return Bad(source, absl::StrCat("indexer of ", ix.num_heads, " heads of ", ix.head_dim,
                                    ", index_topk ", ix.topk, ", index_kpool ", g->index_kpool,
                                    ": every size must be positive"));
  if (ix.topk % g->index_kpool != 0)
    return Bad(source, absl::StrCat("index_topk (", ix.topk, ") must be a multiple of index_kpool (",
                                    g->index_kpool, ")"));
  if (j.contains("index_kpool_always_select_tail") && j["index_kpool_always_select_tail"] == false)
    return absl::UnimplementedError(absl::StrCat(
        source, ": index_kpool_always_select_tail false is not supported (a query would see no "
                "position before its first complete pool)"));
  EXL3_ASSIGN_OR_RETURN(ix.layer_modes, IndexerModes(j, cfg->num_layers, source));
  // transformers hands a layer's selection only to the next decoder layer: a shared indexed
  // layer needs a full indexed layer right before it.
  for (int l = 0; l < cfg->num_layers; ++l) {
    if (cfg->IsLinearAttentionLayer(l) || ix.layer_modes[l] != IndexerMode::kShared) continue;
    if (l == 0 || cfg->IsLinearAttentionLayer(l - 1) || ix.layer_modes[l - 1] != IndexerMode::kFull)
      return Bad(source, absl::StrCat("indexed layer ", l, " is shared, but layer ", l - 1,
                                      " is not a full indexed layer whose selection it could reuse"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ReadGlm5NextSection(const ConfigFile& file, ModelConfig* cfg) {
  const json& j = file.text();
  const std::string& source = file.source();
  auto g = std::make_shared<Glm5NextConfig>();
  cfg->attention = AttentionKind::kPooledDsa;
  cfg->rms_norm_eps = static_cast<float>(NumberField(j, "rms_norm_eps", 1e-5));
  cfg->latent_norm_eps = cfg->rms_norm_eps;
  cfg->dense_swiglu_limit = cfg->moe.swiglu_limit;
  std::string act = "silu";
  if (j.contains("hidden_act"))
    act = j["hidden_act"].is_string() ? j["hidden_act"].get<std::string>() : j["hidden_act"].dump();
  if (act != "silu")
    return absl::UnimplementedError(absl::StrCat(source, ": hidden_act '", act,
                                                 "' (GLM-5.3-Flash runs with silu)"));
  EXL3_RETURN_IF_ERROR(ParseLayerTypes(j, source, cfg));
  EXL3_RETURN_IF_ERROR(ParseKda(j, source, cfg, g.get()));
  EXL3_RETURN_IF_ERROR(ParseIndexedAttention(j, source, cfg, g.get()));
  EXL3_ASSIGN_OR_RETURN(g->hc_mult, IntField(j, "hc_mult", 4, source));
  EXL3_ASSIGN_OR_RETURN(g->hc_sinkhorn_iters, IntField(j, "hc_sinkhorn_iters", 20, source));
  g->hc_eps = static_cast<float>(NumberField(j, "hc_eps", 1e-6));
  if (g->hc_mult < 1 || g->hc_mult > 64 || g->hc_sinkhorn_iters < 1)
    return Bad(source, absl::StrCat("hc_mult ", g->hc_mult, ", hc_sinkhorn_iters ", g->hc_sinkhorn_iters,
                                    ": needs 1..64 streams and at least one Sinkhorn iteration"));
  cfg->glm5next = std::move(g);
  EXL3_ASSIGN_OR_RETURN(cfg->media_placeholders,
                        ReadMediaPlaceholders(file.top(), 154854, 154855, cfg->vocab_size, source));
  cfg->rope = RopeConfig{};  // NoPE: nothing rotates (rotary_dim 0)
  cfg->rope.rotary_dim = 0;
  cfg->attention_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(cfg->qk_nope_head_dim)));
  return absl::OkStatus();
}

}  // namespace exl3::engine
