// The CPU engine's linear-attention factory: the LinearAttention (engine/cpu/linear_attention/linear_attention.h) of a
// layer, of the family's kind, with that layer's weights.
//
//   EXL3_ASSIGN_OR_RETURN(std::unique_ptr<LinearAttention> a, LoadLinearAttention(cfg, src, 0));
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "engine/cpu/linear_attention/linear_attention.h"
#include "engine/config/model_config.h"
#include "model/safetensors.h"

namespace exl3::engine {

// The family's linear attention (GLM-5.3-Flash: KDA, engine/cpu/linear_attention/kimi_delta_attention.h; else the
// gated DeltaNet, engine/cpu/linear_attention/gated_deltanet.h) of `layer`.
absl::StatusOr<std::unique_ptr<LinearAttention>> LoadLinearAttention(const ModelConfig& cfg,
                                                                     const TensorSource& src, int layer);

}  // namespace exl3::engine
