// The CPU engine's attention factory: the Attention (engine/cpu/attention/attention.h) of a layer, of the kind
// cfg.attention names, with that layer's weights. A new attention kind is one class behind
// engine/cpu/attention/attention.h and one line here.
//
//   EXL3_ASSIGN_OR_RETURN(std::unique_ptr<Attention> a, LoadAttention(cfg, src, /*layer=*/3));
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "engine/cpu/attention/attention.h"
#include "engine/config/model_config.h"
#include "model/safetensors.h"

namespace exl3::engine {

// GQA (Glm4Moe, Qwen3Moe, Mixtral), MLA (DeepseekV3), DSA (GlmMoeDsa), DeepSeek-V4's
// (engine/cpu/attention/dsv4_attention.h), GLM-5.3-Flash's pooled DSA (engine/cpu/attention/kpool_dsa_attention.h) or QSA
// (engine/cpu/attention/qsa_attention.h) per cfg.attention, weights of `layer`.
absl::StatusOr<std::unique_ptr<Attention>> LoadAttention(const ModelConfig& cfg,
                                                         const TensorSource& src, int layer);

}  // namespace exl3::engine
