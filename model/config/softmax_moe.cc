#include "model/config/softmax_moe.h"

#include <vector>

#include "base/status_macros.h"

namespace exl3 {

absl::Status ReadQwenMoe(const FieldReader& r, MoeConfig* c) {
  // transformers 5.x writes Qwen3-MoE's expert count as num_local_experts (its
  // Qwen3MoeConfig maps num_experts onto it); older files and Qwen3-Next say num_experts.
  EXL3_RETURN_IF_ERROR(r.OneOfInt("num_local_experts", "num_experts", &c->num_experts));
  EXL3_RETURN_IF_ERROR(r.Int("moe_intermediate_size", &c->moe_intermediate_size));
  int step = 1;
  std::vector<int> mlp_only;
  EXL3_RETURN_IF_ERROR(r.OptInt("decoder_sparse_step", &step));
  EXL3_RETURN_IF_ERROR(r.OptIntList("mlp_only_layers", &mlp_only));
  if (step < 1) return r.Bad("decoder_sparse_step", "must be at least 1");
  for (int l = 0; l < c->num_hidden_layers; ++l) {
    bool only = false;
    for (int m : mlp_only) only |= (m == l);
    c->moe_layers[l] = !only && c->num_experts > 0 && (l + 1) % step == 0;
  }
  // transformers' defaults: Qwen3MoeConfig norm_topk_prob false, Qwen3NextConfig true.
  c->norm_topk_prob = c->family == MoeFamily::kQwen3Next;
  EXL3_RETURN_IF_ERROR(r.OptBool("norm_topk_prob", &c->norm_topk_prob));
  c->scoring = ScoringFunc::kSoftmax;
  if (c->family == MoeFamily::kQwen3Next) {
    EXL3_RETURN_IF_ERROR(r.Int("shared_expert_intermediate_size", &c->shared_intermediate_size));
    c->num_shared_experts = c->shared_intermediate_size > 0 ? 1 : 0;
    c->shared_expert_gated = c->shared_intermediate_size > 0;
  }
  return absl::OkStatus();
}

absl::Status ReadQwen4ExpMoe(const FieldReader& r, MoeConfig* c) {
  // transformers 5.25's Qwen4ExpTextConfig: every layer is MoE (no mlp_only_layers),
  // softmax top-k renormalised by default, one shared expert scaled by
  // sigmoid(shared_expert_gate) as Qwen3-Next's.
  EXL3_RETURN_IF_ERROR(r.Int("num_experts", &c->num_experts));
  EXL3_RETURN_IF_ERROR(r.Int("moe_intermediate_size", &c->moe_intermediate_size));
  EXL3_RETURN_IF_ERROR(r.Int("shared_expert_intermediate_size", &c->shared_intermediate_size));
  if (c->shared_intermediate_size <= 0) {
    return r.Bad("shared_expert_intermediate_size", "must be positive (Qwen4-Exp has a shared expert)");
  }
  for (int l = 0; l < c->num_hidden_layers; ++l) c->moe_layers[l] = true;
  c->norm_topk_prob = true;
  EXL3_RETURN_IF_ERROR(r.OptBool("norm_topk_prob", &c->norm_topk_prob));
  c->scoring = ScoringFunc::kSoftmax;
  c->num_shared_experts = 1;
  c->shared_expert_gated = true;
  return absl::OkStatus();
}

absl::Status ReadMixtralMoe(const FieldReader& r, MoeConfig* c) {
  EXL3_RETURN_IF_ERROR(r.Int("num_local_experts", &c->num_experts));
  EXL3_RETURN_IF_ERROR(r.Int("intermediate_size", &c->moe_intermediate_size));
  for (int l = 0; l < c->num_hidden_layers; ++l) c->moe_layers[l] = true;
  c->norm_topk_prob = true;  // Mixtral always renormalises its top-k
  c->scoring = ScoringFunc::kSoftmax;
  return absl::OkStatus();
}

}  // namespace exl3
