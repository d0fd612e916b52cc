// The CUDA engine's kernels for GLM-5.3-Flash's k-pooled indexer (engine/cpu/attention/kpool_indexer.h has the
// arithmetic): each query token's pool scores, and its chosen pools expanded into the positions it
// attends to. The top pools are chosen by the DSA indexer's device top-k (engine/cuda/
// dsa_indexer_kernels.h's IndexerTopk with pool = P). Host launchers only: this header includes
// no CUDA header; every pointer is device memory, every launch goes on `stream`, none
// synchronises or allocates (CUDA graphs can capture them).
//
// A full indexed layer's cache slot (fp16, engine/config/model_config.h KvWidth): [latent (R), indexer
// key k_i (D), gate score (D)]; the pool keys are formed from the cached k_i and gate each step.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "engine/cuda/attention_kernels.h"

namespace exl3::engine::cuda {

// Pools a score block forms the keys of at a time (what blocks_per_token is chosen against).
inline constexpr int kKpoolScorePoolTile = 16;

struct KpoolIndexerShape {
  int num_heads = 0;    // index_n_heads
  int head_dim = 0;     // D (index_head_dim)
  int pool = 0;         // P (index_kpool)
  int cache_width = 0;  // halves per slot
  int key_offset = 0;   // where k_i starts in a slot; the gate follows it (key_offset + D)
};

// Pool scores of `num_tokens` query tokens starting at token `first_token`: for t = first_token + i
// and every complete pool p < min((position[t] + 1) / P, row_length) of t's sequence,
//   key_p[c] = Σ_j softmax_j(gate[pP + j][c] + ape[j][c]) · k[pP + j][c]   (j < P, per channel c)
//   scores[i * row_length + p] = Σ_h (weights[t, h] · head_weight) · max(q[t, h] · key_p · scale, 0)
// with k and gate read from t's cache slots. q [T, heads, D]; weights [T, heads] (weights_proj's
// output); ape [P, D] (index_kpool_compress_ape). The pool keys are formed in the kernel, in fp32
// (nothing of them is stored); pools of more than 16 positions are refused. `blocks_per_token`
// blocks take each token's pools in turn.
absl::Status KpoolScores(const float* q, const float* weights, float head_weight, float scale, const float* ape,
                         const KvHalf* cache_layer, const AttentionTokens& tokens, const KpoolIndexerShape& shape,
                         int first_token, int num_tokens, int blocks_per_token, float* scores, int row_length,
                         StreamHandle stream);

// For each token t < num_tokens: its chosen pools pools[t * select_pools ..] (pool_count[t] of
// them, ascending) expanded into their positions, then its own incomplete pool's positions
// [⌊(position[t] + 1) / P⌋ · P, position[t]], written ascending to positions[t * stride ..]
// (stride ≥ select_pools · P + P) and their number to count[t].
absl::Status KpoolSelectedPositions(const int32_t* pools, const int32_t* pool_count, int select_pools,
                                    const int32_t* position, int pool, int num_tokens, int32_t* positions,
                                    int32_t* count, int stride, StreamHandle stream);

}  // namespace exl3::engine::cuda
