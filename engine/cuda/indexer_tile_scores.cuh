// The score step the two indexers' CUDA-core kernels share (engine/cuda/dsa_indexer_kernels.cu: a
// key per position; engine/cuda/kpool_indexer_kernels.cu: a key per pool of positions): a token's
// queries against a tile of keys in shared memory, score(key) = Σ_h w_h · relu(q_h · key · scale).
// The threads of a block split as (entry = thread % tile, group = thread / tile): each group sums
// every groups-th head for its entry, then the first `tile` threads add the groups' parts.
#pragma once

#include <cstddef>

namespace exl3::engine::cuda {

// Token t's queries q[t] [NI, D] into qs and its head weights weights[t] [NI] (times head_weight)
// into wt, both in shared memory, by the whole block.
__device__ __forceinline__ void LoadIndexerQuery(const float* q, const float* weights, float head_weight, int t,
                                                 int NI, int D, float* qs, float* wt) {
  for (int e = threadIdx.x; e < NI * D; e += blockDim.x) qs[e] = q[static_cast<size_t>(t) * NI * D + e];
  for (int h = threadIdx.x; h < NI; h += blockDim.x) wt[h] = weights[static_cast<size_t>(t) * NI + h] * head_weight;
}

// This thread's part of entry `entry`'s score: the heads group, group + groups, ... against the
// entry's key (keys: [tile, D + 1], padded), into part[group * tile + entry] [groups, tile].
__device__ __forceinline__ void ScoreIndexerTile(const float* qs, const float* wt, const float* keys, int NI, int D,
                                                 float scale, int entry, int group, int groups, int tile,
                                                 float* part) {
  float s = 0.0f;
  const float* k = keys + entry * (D + 1);
  for (int h = group; h < NI; h += groups) {
    const float* qh = qs + h * D;
    float dot = 0.0f;
    for (int d = 0; d < D; ++d) dot = fmaf(qh[d], k[d], dot);
    s += wt[h] * fmaxf(dot * scale, 0.0f);
  }
  part[group * tile + entry] = s;
}

// After a __syncthreads: the tile's scores, its groups' parts added in group order, into
// row[first + i] for the entries first + i below `count` (compared unsigned, as the kernels
// always did: their sm_90 code is byte for byte what it was before this helper).
__device__ __forceinline__ void SumIndexerTile(const float* part, int groups, int tile, int first, int count,
                                               float* row) {
  if (threadIdx.x < tile && first + threadIdx.x < count) {
    float total = 0.0f;
    for (int g = 0; g < groups; ++g) total += part[g * tile + threadIdx.x];
    row[first + threadIdx.x] = total;
  }
}

}  // namespace exl3::engine::cuda
