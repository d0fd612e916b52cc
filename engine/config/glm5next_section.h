// The configuration section of GLM-5.3-Flash (Glm5NextForConditionalGeneration's text model,
// transformers 5.25's Glm5NextTextConfig; docs/engine.md, "GLM-5.3-Flash"): its own fields fill
// ModelConfig::glm5next (engine/config/glm5next_config.h), the rest the ModelConfig fields they share.
//
//   layer_types       linear_attention (KDA, engine/cpu/linear_attention/kimi_delta_attention.h) or indexed_attention
//                     (NoPE MLA with the k-pooled indexer, engine/cpu/attention/kpool_dsa_attention.h); absent:
//                     layer i is KDA unless i % 4 == 3. "full_attention" reads as indexed.
//   indexer_types     full / shared per layer (or index_topk_pattern, or index_topk_freq /
//                     index_skip_topk_offset); a shared indexed layer reuses the selection of the
//                     layer right before it, which must be a full indexed layer.
//   linear_*          KDA's heads, head size, conv taps and forget-gate lower bound (also from a
//                     `linear_attn_config` dict), into ModelConfig::linear_attention.
//   index_kpool       pool size P of the indexer (index_topk a multiple of it).
//   hc_*              the hyper-connections (engine/cpu/residual/hyper_connections.h); the head is a mean.
//
// The fields come from config.json's text_config (model/config/config_file.h ConfigFile::text).
#pragma once

#include "absl/status/status.h"
#include "engine/config/model_config.h"
#include "model/config/config_file.h"

namespace exl3::engine {

// Fills cfg (attention kPooledDsa, layer_mixers, linear_attention, the MLA shape, indexer,
// latent norm eps, dense MLP clamp, glm5next, the NoPE rope and the softmax scale) from the text
// config. Refuses by name what transformers refuses (rope in the MLA, a config whose shared indexer layer has no full layer
// right before it, index_topk not a multiple of index_kpool, heads != KV heads) and what the
// engine does not run (index_kpool_always_select_tail false, hidden_act other than silu).
absl::Status ReadGlm5NextSection(const ConfigFile& file, ModelConfig* cfg);

}  // namespace exl3::engine
