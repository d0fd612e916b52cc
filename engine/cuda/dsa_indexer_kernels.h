// The CUDA engine's kernels for GLM-MoE-DSA's lightning indexer (engine/cpu/attention/dsa_attention.h has the
// arithmetic): the indexer key's LayerNorm and cache write, the per-position index scores and the
// device top-k that chooses each query token's positions. Host launchers only: this header
// includes no CUDA header; every pointer is device memory, every launch goes on `stream`, none
// synchronises or allocates (CUDA graphs can capture them).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "engine/cuda/attention_kernels.h"

namespace exl3::engine::cuda {

// x[r] = (x[r] - mean) / sqrt(var + eps) * w + b for `rows` rows of n floats, in place (mean and
// variance in double, as engine/cpu/attention/dsa_attention.cc's LayerNormInPlace).
absl::Status LayerNormRows(float* x, const float* w, const float* b, int rows, int n, float eps,
                           StreamHandle stream);

// cache_layer[slot[t] * width + offset + i] = fp16(x[t * n + i]) for i < n.
absl::Status WriteRowsToCache(const float* x, int num_tokens, int n, const int32_t* slot,
                              KvHalf* cache_layer, int width, int offset, StreamHandle stream);

// The indexer's shape and where its keys sit in a slot.
struct IndexerShape {
  int num_heads = 0;   // index_n_heads
  int head_dim = 0;    // index_head_dim
  int cache_width = 0;  // halves per slot
  int key_offset = 0;   // where the indexer key starts in a slot
};

// Index scores of `num_tokens` query tokens starting at token `first_token`:
// scores[i * row_length + j] = Σ_h (weights[t, h] * head_weight) * max(q[t, h] · key_j * scale, 0)
// for t = first_token + i and every position j ≤ min(position[t], row_length - 1), key_j the
// indexer key cached for j in t's sequence. q [T, heads, head_dim] (rotated); weights [T, heads]
// (weights_proj's output). `blocks_per_token` blocks take each token's positions in turn.
// tensor_cores: the q · key products on tensor cores (wmma; q rounded to fp16, fp32 sums: about
// 5e-4 relative, so selections near a tie may differ from the CPU engine's more often), where
// IndexerTensorCoresSupport; else fp32 on CUDA cores.
absl::Status IndexerScores(const float* q, const float* weights, float head_weight, float scale,
                           const KvHalf* cache_layer, const AttentionTokens& tokens,
                           const IndexerShape& shape, int first_token, int num_tokens,
                           int blocks_per_token, float* scores, int row_length, StreamHandle stream,
                           bool tensor_cores = false);
// Index heads and head_dim multiples of 16, the key's offset and the slot multiples of 8 halves.
bool IndexerTensorCoresSupport(const IndexerShape& shape);

// Per query token t = first_token + i, its n = min((position[t] + 1) / pool, row_length) scores in
// scores[i * row_length ..] (pool 1: one per position; GLM-5.3-Flash's indexer scores the complete
// pools of `pool` positions, engine/cuda/kpool_indexer_kernels.h): when n ≤ topk every candidate
// 0..n-1, else the topk highest (ties: the lower candidate first, as engine/cpu/attention/dsa_attention.cc's and
// engine/cpu/attention/kpool_indexer.cc's partial_sort; +0 and -0 equal), written ascending to
// selected[t * topk ..] and their number to count[t].
absl::Status IndexerTopk(const float* scores, int row_length, const int32_t* position, int first_token,
                         int num_tokens, int topk, int32_t* selected, int32_t* count, StreamHandle stream,
                         int pool = 1);

}  // namespace exl3::engine::cuda
