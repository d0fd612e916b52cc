// Qwen4-Exp's QSA attention (`indexed_attention` layers) on the GPU as a mixer kind
// (engine/cuda/cuda_mixer.h): the CPU engine's engine/cpu/attention/qsa_attention.h on device memory. Per layer:
//
//   q|gate = q_proj(x), k, v, iqk = index_qk_proj(x)           (CudaLinear, one shared launch)
//   q, k: zero-centred q_norm / k_norm, rope; k, v → the fp16 cache (WriteKv)
//   iqk → the indexer's query heads (q_layernorm, rope) and the raw key → its fp32 cache
//   per query: block scores over its sequence's complete blocks, the budget/m best (ties: the
//   earlier block) plus the incomplete tail as its positions        (engine/cuda/qsa_kernels.h)
//   attention over those positions · sigmoid(gate) → o_proj
//
// The kind holds every QSA layer's caches (fp16 keys and values, fp32 raw indexer keys: the
// selection compares block scores, which fp16 keys would move by ~1e-3), the angles of every
// block's first position (the block keys' rope; the cache never reaches past
// max_position_embeddings, so dynamic NTK's angles are the static ones there) and the workspace the
// layers share. A layer runs any rows of a step (two micro-batches), its workspaces the call's own.
#pragma once

#include <memory>

#include "engine/cuda/cuda_mixer.h"

namespace exl3::engine::cuda {

std::unique_ptr<CudaMixerKind> MakeQsaKind(const ModelConfig& cfg, const CudaLinearContext& linear);

}  // namespace exl3::engine::cuda
