#include "model/config/deepseek_v4_moe.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace exl3 {

absl::Status ReadDeepseekV4Moe(const FieldReader& r, MoeConfig* c) {
  // Facts from transformers 5.24's DeepseekV4Config / modeling_deepseek_v4: every layer is
  // MoE; mlp_layer_types names each "hash_moe" or "moe" (older files: the first
  // num_hash_layers layers, 3 when neither is given); one shared expert of
  // moe_intermediate_size; no grouped routing; the chosen weights are always renormalised
  // (norm_topk_prob is not read) and scaled by routed_scaling_factor (default 1.5; older
  // files: route_scale); swiglu_limit defaults to 10.
  EXL3_RETURN_IF_ERROR(r.Int("n_routed_experts", &c->num_experts));
  EXL3_RETURN_IF_ERROR(r.Int("moe_intermediate_size", &c->moe_intermediate_size));
  int shared = 1;
  EXL3_RETURN_IF_ERROR(r.OptInt("n_shared_experts", &shared));
  if (shared != 1) {
    return r.Bad("n_shared_experts", absl::StrCat("is ", shared, "; ", c->architecture,
                                                  " has exactly one shared expert"));
  }
  c->num_shared_experts = 1;
  c->shared_intermediate_size = c->moe_intermediate_size;
  for (int l = 0; l < c->num_hidden_layers; ++l) c->moe_layers[l] = true;
  bool listed = false;
  EXL3_RETURN_IF_ERROR(r.OptLayerFlags("mlp_layer_types", c->num_hidden_layers, "moe", "hash_moe",
                                       &c->hash_routed_layers, &listed));
  if (!listed) {
    int n_hash = 3;
    EXL3_RETURN_IF_ERROR(r.OptInt("num_hash_layers", &n_hash));
    EXL3_RETURN_IF_ERROR(r.OptInt("n_hash_layers", &n_hash));
    for (int l = 0; l < c->num_hidden_layers; ++l) c->hash_routed_layers[l] = l < n_hash;
  }
  c->norm_topk_prob = true;
  c->routed_scaling_factor = 1.5f;
  EXL3_RETURN_IF_ERROR(r.OptFloat("route_scale", &c->routed_scaling_factor));
  EXL3_RETURN_IF_ERROR(r.OptFloat("routed_scaling_factor", &c->routed_scaling_factor));
  c->has_correction_bias = true;
  std::string scoring = "sqrtsoftplus";
  EXL3_RETURN_IF_ERROR(r.OptString("scoring_func", &scoring));
  if (scoring == "sqrtsoftplus") {
    c->scoring = ScoringFunc::kSqrtSoftplus;
  } else if (scoring == "sigmoid") {
    c->scoring = ScoringFunc::kSigmoid;
  } else {
    return r.Bad("scoring_func", absl::StrCat("is '", scoring, "'; ", c->architecture,
                                              " is supported with sqrtsoftplus or sigmoid"));
  }
  c->swiglu_limit = 10.0f;
  EXL3_RETURN_IF_ERROR(r.OptFloat("swiglu_limit", &c->swiglu_limit));
  return absl::OkStatus();
}

}  // namespace exl3
