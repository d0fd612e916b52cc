// GLM-5.3-Flash's k-pooled DSA selection (transformers 5.25's Glm5NextTextIndexer), in fp32.
// Positions form pools of P from position 0 (pool p: [pP, pP + P)); only complete pools are
// candidates. A pool's key, per channel c, is the softmax over its P positions of
// (gate[j][c] + ape[j - pP][c]) weighting k[j][c]. A query at position t with per-head queries
// q [heads, D] and head weights w [heads] (weights_proj(x) / √heads) scores each complete pool
// that ends at or before t as Σ_h w[h] · relu(q[h] · pool_key / √D), keeps the `select_pools`
// highest (all of them while there are no more; ties: the lower pool) and attends to their
// positions plus its own incomplete pool's, [⌊(t + 1) / P⌋ · P, t] (the tail, always selected).
#pragma once

#include <cstdint>
#include <vector>

namespace exl3::engine {

struct KpoolShape {
  int num_heads = 0;
  int head_dim = 0;      // D
  int pool = 0;          // P (index_kpool)
  int select_pools = 0;  // index_topk / index_kpool
};

// Keys of the complete pools of positions [0, num_positions): [num_positions / P][D]. keys and
// gates [num_positions][D]; ape [P][D].
std::vector<float> KpoolKeys(const float* keys, const float* gates, int num_positions,
                             const float* ape, const KpoolShape& shape);

// The positions, ascending, the query at `position` attends to; pool_keys holds at least the
// (position + 1) / P complete pools it sees.
std::vector<int32_t> SelectPooledPositions(const float* q, const float* w, const float* pool_keys,
                                           int position, const KpoolShape& shape);

}  // namespace exl3::engine
