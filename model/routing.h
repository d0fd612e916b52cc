// Expert routing exactly as the model families define it (docs/format.md, "Routing functions").
//
// Usage:
//   std::vector<int32_t> ids(T * cfg.top_k);
//   std::vector<float> weights(T * cfg.top_k);
//   absl::Status s = RouteTokens(cfg, layer, router_w /*[E, hidden] fp32*/, bias /*[E] or null*/,
//                                x /*[T, hidden] fp32*/, T, ids.data(), weights.data());
//
// Per token the k chosen experts are written in descending order of their selection score (the
// biased score for sigmoid/sqrt-softplus routers); equal scores: the lower expert index wins.
// Softmax (Qwen3-MoE/Next, Mixtral): p = softmax(logits); top-k; renormalised when
//   norm_topk_prob (Mixtral always).
// Sigmoid (GLM, DeepSeek-V3) and sqrt-softplus (DeepSeek-V4): s = score(logits); choose by
//   s + bias, grouped (groups scored by the sum of their top-2 biased scores, best topk_group
//   kept, the other groups' experts never chosen: transformers 5.x masks them with -inf);
//   weights = unbiased s of the chosen, divided by (sum + 1e-20) when norm_topk_prob, times
//   routed_scaling_factor (DeepSeek-V4: always renormalised, no groups).
// Hash-routed layers (DeepSeek-V4's first layers) need token ids: RouteTokens refuses them;
//   use RouteHashed.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "model/moe_config.h"

namespace exl3 {

// logits[t, e] = sum_i x[t, i] * w[e, i], fp32 inputs, accumulated in double, rounded to fp32.
void ComputeRouterLogits(const float* router_weight, const float* x, int num_tokens,
                         int num_experts, int hidden, float* logits);

// Routes from precomputed router logits [T, E] (fp32). `bias` [E] is the correction bias of
// sigmoid/sqrt-softplus routers (null: zero). Errors: hash-routed layer, non-finite logits,
// non-MoE layer.
absl::Status RouteFromLogits(const MoeConfig& cfg, int layer, const float* logits,
                             const float* bias, int num_tokens, int32_t* topk_ids,
                             float* topk_weights);

// Router logits from hidden states x [T, hidden] and router weight [E, hidden], then
// RouteFromLogits.
absl::Status RouteTokens(const MoeConfig& cfg, int layer, const float* router_weight,
                         const float* bias, const float* x, int num_tokens, int32_t* topk_ids,
                         float* topk_weights);

// DeepSeek-V4 hash-routed layer: experts = tid2eid[token_id] ([vocab, top_k]); weights are the
// sqrt-softplus scores of those experts from `logits` [T, E], renormalised (norm_topk_prob) and
// scaled. Errors for token ids outside the table or table entries outside [0, E).
absl::Status RouteHashed(const MoeConfig& cfg, int layer, const float* logits,
                         const int32_t* tid2eid, int64_t vocab_size, const int64_t* token_ids,
                         int num_tokens, int32_t* topk_ids, float* topk_weights);

}  // namespace exl3
