// Latent attention on the GPU as a mixer kind (engine/cuda/cuda_mixer.h): DeepSeek-V3's MLA and
// GLM-MoE-DSA's (engine/cuda/latent_attention.h computes a layer). The kind holds every latent
// layer's fp16 cache ([latent | rope key | own indexer's key] per slot) and the workspace they
// share; a layer runs any rows of a step (two micro-batches), its DSA selection kept at the step's
// rows for the layers that share it.
#pragma once

#include <memory>

#include "engine/cuda/cuda_mixer.h"

namespace exl3::engine::cuda {

std::unique_ptr<CudaMixerKind> MakeLatentKind(const ModelConfig& cfg, const CudaLinearContext& linear);

}  // namespace exl3::engine::cuda
