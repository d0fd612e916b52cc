// GLM-5.3-Flash's indexed attention on the GPU as a mixer kind (engine/cuda/cuda_mixer.h):
// engine/cuda/kpool_attention.h computes a layer. The kind holds every indexed layer's fp16 cache
// ([latent | k_i | gate] on full layers, the latent alone on shared ones) and the workspaces they
// share; a layer runs any rows of a step (two micro-batches), a full layer's selection kept at the
// step's rows for the shared layers after it.
#pragma once

#include <memory>

#include "engine/cuda/cuda_mixer.h"

namespace exl3::engine::cuda {

std::unique_ptr<CudaMixerKind> MakeKpoolKind(const ModelConfig& cfg, const CudaLinearContext& linear);

}  // namespace exl3::engine::cuda
