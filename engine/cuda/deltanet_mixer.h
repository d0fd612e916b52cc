// Qwen3-Next's gated DeltaNet layers as a mixer kind (engine/cuda/cuda_mixer.h;
// engine/cuda/cuda_gated_deltanet.h computes a layer). The kind holds the per-sequence recurrent
// state of its layers (engine/cuda/device_sequence_states.h: a step reads each chunk's current copy
// and writes the other, committed only once the step has succeeded) and the step's chunk table:
// per row its chunk, per chunk [first row, rows, state row read, state row written], one chunk per
// padding row of a decode graph (reading the store's zero row, writing its spare row), so a
// captured decode step replays for any slots.
#pragma once

#include <memory>

#include "engine/cuda/cuda_mixer.h"

namespace exl3::engine::cuda {

std::unique_ptr<CudaMixerKind> MakeDeltaNetKind(const ModelConfig& cfg, const CudaLinearContext& linear);

}  // namespace exl3::engine::cuda
