// The kernels of Qwen4-Exp's QSA attention on the GPU (engine/cuda/qsa_mixer.h runs them; the CPU
// engine's engine/cpu/attention/qsa_attention.h states the arithmetic): the indexer's raw keys into their fp32
// cache, each query's block scores, and the gated GQA's attention over the positions each query
// selected (the selection itself is the DSA indexer's device top-k over blocks of m positions and
// the k-pooled indexer's expansion into positions: engine/cuda/dsa_indexer_kernels.h IndexerTopk
// with pool = m, engine/cuda/kpool_indexer_kernels.h KpoolSelectedPositions, whose rules, ties to
// the earlier block and the incomplete tail, are QSA's). Host launchers only: this header includes
// no CUDA header; every pointer is device memory, every launch goes on `stream`, none synchronises
// or allocates, and 0 tokens launch nothing.
//
// A QSA layer's caches: keys and values fp16 [slots, 2 * kv_heads * head_dim] as WriteKv writes
// them (engine/cuda/attention_kernels.h), and the raw indexer keys fp32 [slots, indexer head_dim].
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "engine/cuda/attention_kernels.h"

namespace exl3::engine::cuda {

// The indexer's shape (engine/config/qwen4exp_config.h QsaIndexerConfig).
struct QsaIndexerShape {
  int num_heads = 0;       // query heads
  int head_dim = 0;        // ≤ kQsaMaxIndexerHeadDim
  int compress_ratio = 0;  // m: positions per block
  float eps = 0.0f;        // k_layernorm's
};
inline constexpr int kQsaMaxIndexerHeadDim = 256;

// index_qk_proj's output iqk [T, (heads + 1) · head_dim] (the query heads, then the raw key) split:
// iq [T, heads · head_dim] = the query heads, key_cache[slot[t] · head_dim ..] = the raw key.
absl::Status QsaSplitIndexer(const float* iqk, const int32_t* slot, int num_tokens, int heads, int head_dim,
                             float* iq, float* key_cache, StreamHandle stream);

// Each query token t < T (its query heads iq [T, heads · head_dim], normed and rotated): for each
// complete block b < min((position[t] + 1) / m, row_length) of its sequence,
//   key_b = rope(RMSNorm(mean of the raw keys of positions b·m .. b·m + m − 1) · k_norm) at b·m
//   scores[t · row_length + b] = Σ_h relu(iq[t, h] · key_b) / √head_dim
// with the raw keys read from key_cache through the tokens' block tables. k_norm [head_dim] (1 + w);
// block_cos / block_sin [blocks, rotary_half]: the angles of position b·m (half-split rope on the
// first 2 · rotary_half dims, 2 · rotary_half ≤ head_dim). The block keys are formed in the kernel
// (nothing of them is stored), the norm's sum in double as the CPU's.
absl::Status QsaBlockScores(const float* iq, const float* key_cache, const AttentionTokens& tokens,
                            const QsaIndexerShape& shape, const float* k_norm, const float* block_cos,
                            const float* block_sin, int rotary_half, int num_tokens, float* scores, int row_length,
                            StreamHandle stream);

// Each query token t < T and head h: out[t, h] = softmax(scale · q[t, h] · K[p]) · V[p] over the
// positions p = positions[t · stride + i], i < count[t] (count[t] ≥ 1), of t's sequence (keys and
// values of KV head h / (num_heads / num_kv_heads)). q, out [T, num_heads · head_dim] fp32; kv_cache
// as WriteKv wrote it; the shape as QsaAttentionShapeSupported allows. Few
// tokens split their positions over several thread blocks (flash decoding) whose partial outputs
// go to `workspace`, QsaAttentionWorkspaceFloats of them for up to T tokens.
absl::Status QsaAttention(const float* q, const KvHalf* kv_cache, const AttentionTokens& tokens,
                          const int32_t* positions, const int32_t* count, int stride, int num_tokens, int num_heads,
                          int num_kv_heads, int head_dim, float scale, float* out, float* workspace,
                          size_t workspace_floats, StreamHandle stream);
inline constexpr int kQsaMaxHeadDim = 256;
// 1, 2, 4, 8 or 16 query heads a KV head, head_dim ≤ kQsaMaxHeadDim.
bool QsaAttentionShapeSupported(int num_heads, int num_kv_heads, int head_dim);

// The workspace QsaAttention needs for any step of up to `max_tokens` tokens (0 when none splits).
size_t QsaAttentionWorkspaceFloats(int max_tokens, int num_heads, int num_kv_heads, int head_dim, int stride);

}  // namespace exl3::engine::cuda
