// Qwen3-Next's gated DeltaNet layers as a mixer kind (engine/cuda/cuda_mixer.h;
// engine/cuda/cuda_gated_deltanet.h computes a layer). The kind holds its layers' per-sequence
// recurrent state and the step's chunk table (engine/cuda/recurrent_layer_states.h), shared with
// GLM-5.3-Flash's KDA kind (engine/cuda/kda_mixer.h).
#pragma once

#include <memory>

#include "engine/cuda/cuda_mixer.h"

namespace exl3::engine::cuda {

std::unique_ptr<CudaMixerKind> MakeDeltaNetKind(const ModelConfig& cfg, const CudaLinearContext& linear);

}  // namespace exl3::engine::cuda
