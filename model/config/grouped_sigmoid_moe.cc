#include "model/config/grouped_sigmoid_moe.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace exl3 {

absl::Status ReadGroupedSigmoidMoe(const FieldReader& r, MoeConfig* c) {
  // Where a field is absent, the default of the family's transformers config class:
  // n_shared_experts 1, norm_topk_prob true; routed_scaling_factor 1.0 (Glm4Moe) or 2.5
  // (GlmMoeDsa, DeepseekV3); n_group / topk_group 1 / 1, DeepSeek-V3 8 / 4.
  const bool glm4 = c->arch == Architecture::kGlm4Moe;
  const bool glm5_next = c->arch == Architecture::kGlm5Next;
  c->num_shared_experts = 1;
  if (glm5_next) c->swiglu_limit = 10.0f;  // Glm5NextTextConfig's default
  EXL3_RETURN_IF_ERROR(r.OptFloat("swiglu_limit", &c->swiglu_limit));
  c->routed_scaling_factor = glm4 ? 1.0f : 2.5f;
  if (c->family == MoeFamily::kDeepseekV3) {
    c->n_group = 8;
    c->topk_group = 4;
  }
  EXL3_RETURN_IF_ERROR(r.Int("n_routed_experts", &c->num_experts));
  EXL3_RETURN_IF_ERROR(r.Int("moe_intermediate_size", &c->moe_intermediate_size));
  EXL3_RETURN_IF_ERROR(r.OptInt("n_shared_experts", &c->num_shared_experts));
  c->shared_intermediate_size = c->num_shared_experts * c->moe_intermediate_size;
  // GLM-MoE-DSA (GLM-5) names each layer's MLP in mlp_layer_types ("dense" / "sparse"; its
  // transformers config derives the list from first_k_dense_replace when absent); GLM-4.x MoE
  // and DeepSeek-V3 use first_k_dense_replace (and DeepSeek-V2-era files moe_layer_freq).
  bool listed = false;
  if (c->arch == Architecture::kGlmMoeDsa || glm5_next) {
    EXL3_RETURN_IF_ERROR(r.OptLayerFlags("mlp_layer_types", c->num_hidden_layers, "dense", "sparse",
                                         &c->moe_layers, &listed));
  }
  if (!listed && glm5_next) {
    // Glm5NextTextConfig: the first min(3, layers) layers dense, the rest sparse.
    for (int l = 0; l < c->num_hidden_layers; ++l) c->moe_layers[l] = l >= 3;
    listed = true;
  }
  if (!listed) {
    int first_dense = 0, freq = 1;
    EXL3_RETURN_IF_ERROR(r.Int("first_k_dense_replace", &first_dense));
    EXL3_RETURN_IF_ERROR(r.OptInt("moe_layer_freq", &freq));
    if (freq < 1) return r.Bad("moe_layer_freq", "must be at least 1");
    for (int l = 0; l < c->num_hidden_layers; ++l) {
      c->moe_layers[l] = l >= first_dense && l % freq == 0;
    }
  }
  c->norm_topk_prob = true;
  EXL3_RETURN_IF_ERROR(r.OptBool("norm_topk_prob", &c->norm_topk_prob));
  EXL3_RETURN_IF_ERROR(r.OptFloat("routed_scaling_factor", &c->routed_scaling_factor));
  EXL3_RETURN_IF_ERROR(r.OptInt("n_group", &c->n_group));
  EXL3_RETURN_IF_ERROR(r.OptInt("topk_group", &c->topk_group));
  c->has_correction_bias = true;
  c->scoring = ScoringFunc::kSigmoid;
  if (c->family == MoeFamily::kDeepseekV3) {
    std::string scoring = "sigmoid";
    EXL3_RETURN_IF_ERROR(r.OptString("scoring_func", &scoring));
    if (scoring != "sigmoid") {
      return r.Bad("scoring_func", absl::StrCat("is '", scoring, "'; ", c->architecture,
                                                " is supported with sigmoid"));
    }
  }
  std::string topk_method = "noaux_tc";
  EXL3_RETURN_IF_ERROR(r.OptString("topk_method", &topk_method));
  if (topk_method != "noaux_tc") {
    return r.Bad("topk_method", absl::StrCat("is '", topk_method, "'; only noaux_tc is supported"));
  }
  return absl::OkStatus();
}

}  // namespace exl3
