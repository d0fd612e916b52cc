// Grouped-query attention on the GPU (Glm4Moe, Qwen3Moe, Mixtral; Qwen3-Next's gated full
// attention): the CPU engine's engine/cpu/attention/gqa_attention.h on device memory.
//
//   q, k, v = q_proj(x), k_proj(x), v_proj(x)   (one shared launch for EXL3 layers; gated
//                                                attention: q_proj gives each head's query, then its output gate)
//   q, k    = rmsnorm per head (qk_norm), RoPE (partial where rotary_dim < head_dim)
//   cache  <- fp16 [k | v] per slot
//   o       = attention over the paged cache: the tensor-core prefill kernel for prefill chunks,
//             the split-K decode kernel for decode-like tokens (engine/cuda/attention_kernels.h)
//   out     = o_proj(o · sigmoid(gate)) (gated) or o_proj(o)
#pragma once

#include <memory>

#include "engine/cuda/cuda_mixer.h"

namespace exl3::engine::cuda {

std::unique_ptr<CudaMixerKind> MakeGqaKind(const ModelConfig& cfg, const CudaLinearContext& linear);

}  // namespace exl3::engine::cuda
