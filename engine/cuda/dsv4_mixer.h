// DeepSeek-V4's attention as a mixer kind (engine/cuda/cuda_mixer.h; engine/cuda/dsv4_attention.h
// computes a layer). The kind holds the fp32 cache in the CPU engine's layout (per layer
// num_blocks + 1 blocks of block_size slots and the block area, zeroed as the CPU's is), the
// workspace and the step's V4 facts (Dsv4StepFacts: chunk starts, four rope tables, the indexer's
// entry counts), which live outside the step's fact array: so V4 decode steps run eagerly, and
// the compressors' fold reports an error through a word read after the step (EndStep). With
// speculative decoding it also holds each compressed layer's kept accumulators and their
// bookkeeping (engine/cuda/dsv4_kept_row_slots.h): each chunk's keeping goes into the step's fact
// array (PackStep), and EndStep commits what a successful step kept.
#pragma once

#include <memory>

#include "engine/cuda/cuda_mixer.h"

namespace exl3::engine::cuda {

absl::StatusOr<std::unique_ptr<CudaMixerKind>> MakeDsv4Kind(const ModelConfig& cfg, const CudaLinearContext& linear);

}  // namespace exl3::engine::cuda
