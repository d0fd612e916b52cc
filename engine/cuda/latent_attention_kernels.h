// The CUDA engine's kernels for multi-head latent attention (DeepSeek-V3 MLA, and GLM-MoE-DSA's
// attention over the positions its indexer chose): the latent cache write and split-K attention
// in the latent space with absorbed weights (engine/cpu/attention/mla_attention.h has the arithmetic). Host
// launchers only: this header includes no CUDA header. Every pointer is device memory, every
// launch goes on `stream` and none synchronises or allocates, so a step can be captured in a
// CUDA graph.
//
// A latent layer's cache slot (fp16, `width` halves, the CPU engine's slot layout of
// engine/config/model_config.h KvWidth): [latent (R = kv_lora_rank), rotated shared rope key
// (qk_rope_head_dim), and on DSA layers with their own indexer the indexer key (index_head_dim)].
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "engine/cuda/attention_kernels.h"

namespace exl3::engine::cuda {

// For each token t: the first R floats of ckv[t] (kv_a_proj_with_mqa's output [T, R + rope])
// RMS-normalised with weight w [R] (mean of squares in double, as engine/cpu/rms_norm.h), then the
// rope key ckv[t, R..R+rope) as it is (rotated before), written as fp16 to
// cache_layer[slot[t] * width + 0 .. R + rope).
absl::Status WriteLatentToCache(const float* ckv, const float* w, int num_tokens, int latent_dim,
                                int rope_dim, float eps, const int32_t* slot, KvHalf* cache_layer,
                                int width, StreamHandle stream);

// The positions each query token attends to, when not its causal range: token t sees
// positions[t * stride + i] for i < count[t] (DSA's top-k selection).
struct LatentSelection {
  const int32_t* positions = nullptr;  // [T, stride]
  const int32_t* count = nullptr;      // [T]
  int stride = 0;
};

// Attention in the latent space, every query token on its own (decode, and prefill through the
// same path): for token t and head h, with s_j = scale * (q_latent[t, h] · latent_j +
// q[t, h, nope..] · rope_key_j) over the positions t sees (its range [first_visible, position], or
// the selection's list when `selection` is given), out_latent[t, h] = Σ softmax(s)_j latent_j.
// q_latent [T, heads, R]; q [T, heads, q_stride] with the rotated rope part at rope_offset;
// out_latent [T, heads, R]. A block takes one token, a tile of up to 16 heads and one split of
// its positions (*split_positions per split, the last taking the rest), reading each cached
// position once for the tile's heads; with splits > 1 the partials go to `scratch`
// (LatentAttentionScratchFloats) and a second kernel combines them.
struct LatentAttentionShape {
  int num_heads = 0;
  int latent_dim = 0;   // R
  int rope_dim = 0;
  int q_stride = 0;     // floats per head in q
  int rope_offset = 0;  // where the rope part starts in a head of q
  int cache_width = 0;  // halves per slot
  float scale = 0.0f;
};
// Which kernel runs the products: fp32 CUDA cores throughout, or tensor cores (wmma fp16 → fp32:
// the queries and the softmax probabilities rounded to fp16 for the products, about 5e-4
// relative, as the GQA tensor-core kernels; latent and rope dims multiples of 16, slots a
// multiple of 8 halves: LatentTensorCoresSupport).
enum class LatentKernel { kCudaCores, kTensorCores };
bool LatentTensorCoresSupport(const LatentAttentionShape& shape);

// Blocks per token and split (tiles of up to 16 heads): what a split count is chosen against.
int LatentAttentionHeadTiles(int num_heads);
int64_t LatentAttentionScratchFloats(int num_tokens, int num_heads, int latent_dim, int splits);
absl::Status LatentAttention(const float* q_latent, const float* q, const KvHalf* cache_layer,
                             const AttentionTokens& tokens, const LatentSelection* selection,
                             int num_tokens, const LatentAttentionShape& shape, int splits,
                             const int32_t* split_positions, float* scratch, float* out_latent,
                             StreamHandle stream, LatentKernel kernel = LatentKernel::kCudaCores);

}  // namespace exl3::engine::cuda
