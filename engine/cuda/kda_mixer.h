// GLM-5.3-Flash's KDA (Kimi delta attention) layers as a mixer kind (engine/cuda/cuda_mixer.h;
// engine/cuda/cuda_kimi_delta_attention.h computes a layer). The kind holds its layers'
// per-sequence recurrent state and the step's chunk table (engine/cuda/recurrent_layer_states.h),
// as the gated DeltaNet's kind does (engine/cuda/deltanet_mixer.h).
#pragma once

#include <memory>

#include "engine/cuda/cuda_mixer.h"

namespace exl3::engine::cuda {

std::unique_ptr<CudaMixerKind> MakeKdaKind(const ModelConfig& cfg, const CudaLinearContext& linear);

}  // namespace exl3::engine::cuda
