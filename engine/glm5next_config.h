// GLM-5.3-Flash's (Glm5NextForConditionalGeneration, transformers 5.25's Glm5NextTextConfig) own
// fields, beside the ModelConfig they fill (docs/engine.md, "GLM-5.3-Flash"):
//
//   layer_types       linear_attention (KDA, engine/kimi_delta_attention.h) or indexed_attention
//                     (NoPE MLA with the k-pooled indexer, engine/kpool_dsa_attention.h); absent:
//                     layer i is KDA unless i % 4 == 3. "full_attention" reads as indexed.
//   indexer_types     full / shared per layer (or index_topk_pattern, or index_topk_freq /
//                     index_skip_topk_offset); a shared indexed layer reuses the selection of the
//                     layer right before it, which must be a full indexed layer.
//   linear_*          KDA's heads, head size, conv taps and forget-gate lower bound (also from a
//                     `linear_attn_config` dict), into ModelConfig::linear_attention.
//   index_kpool       pool size P of the indexer (index_topk a multiple of it).
//   hc_*              the hyper-connections (engine/hyper_connections.h); the head is a mean.
//
// ParseModelConfig calls ParseGlm5NextConfig with config.json's text config
// (model/moe_config.h's LiftTextConfig).
#pragma once

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "engine/model_config.h"
#include "nlohmann/json_fwd.hpp"

namespace exl3::engine {

struct Glm5NextConfig {
  int index_kpool = 16;  // P: positions per pool of the indexer
  // KDA's forget gate: log-decay = lower_bound · sigmoid(exp(A_log) · g) with a bound
  // (linear_lower_bound, -5 by default), −exp(A_log) · softplus(g) without one (null).
  std::optional<float> gate_lower_bound;
  int hc_mult = 4;
  int hc_sinkhorn_iters = 20;
  float hc_eps = 1e-6f;
};

// Fills cfg (attention kPooledDsa, layer_mixers, linear_attention, the MLA shape, indexer,
// latent norm eps, dense MLP clamp, glm5next) from the text config `j`. Refuses by name what
// transformers refuses (rope in the MLA, a config whose shared indexer layer has no full layer
// right before it, index_topk not a multiple of index_kpool, heads != KV heads) and what the
// engine does not run (index_kpool_always_select_tail false, hidden_act other than silu).
absl::Status ParseGlm5NextConfig(const nlohmann::json& j, const std::string& source, ModelConfig* cfg);

}  // namespace exl3::engine
