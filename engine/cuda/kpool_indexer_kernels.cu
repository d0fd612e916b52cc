#include "engine/cuda/kpool_indexer_kernels.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "engine/cuda/indexer_tile_scores.cuh"
#include "engine/cuda/launch_status.cuh"
#include "kernels/cuda/launch.cuh"

namespace exl3::engine::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kPoolTile = kKpoolScorePoolTile;
constexpr int kHeadGroups = kThreads / kPoolTile;  // threads per pool, each summing every 16th head
constexpr int kMaxPool = 16;  // positions per pool a thread holds in registers (GLM-5.3-Flash's index_kpool)

// grid (blocks_per_token, tokens), kThreads threads. Shared: the token's queries [NI, D], its head
// weights [NI], a tile of pool keys [kPoolTile, D + 1] (padded: conflict-free reads across pools)
// and the head groups' partial sums [kHeadGroups, kPoolTile].
__global__ void KpoolScoresKernel(const float* q, const float* weights, float head_weight, float scale,
                                  const float* ape, const __half* cache, AttentionTokens at, KpoolIndexerShape shape,
                                  int first_token, float* scores, int row_length) {
  exl3::cuda::PdlEnter();
  extern __shared__ float smem[];
  const int NI = shape.num_heads, D = shape.head_dim, P = shape.pool;
  float* qs = smem;
  float* wt = qs + NI * D;
  float* keys = wt + NI;
  float* part = keys + kPoolTile * (D + 1);
  const int t = first_token + blockIdx.y;
  const int pools = min((at.position[t] + 1) / P, row_length);
  const int32_t* table = at.tables + at.table_offset[t];
  const int bs = at.block_size;
  const int gate_offset = shape.key_offset + D;
  LoadIndexerQuery(q, weights, head_weight, t, NI, D, qs, wt);
  float* row = scores + static_cast<size_t>(blockIdx.y) * row_length;
  const int pp = threadIdx.x % kPoolTile, group = threadIdx.x / kPoolTile;
  for (int tile = blockIdx.x * kPoolTile; tile < pools; tile += gridDim.x * kPoolTile) {
    __syncthreads();  // queries loaded; the previous tile's keys and partials consumed
    // The tile's pool keys: one thread per (pool, channel), the softmax over the pool's positions
    // in the CPU engine's order (max, sum, then the normalised weights times k). The pool's gate
    // logits and keys are read once into registers, every load issued before the first is used.
    for (int e = threadIdx.x; e < kPoolTile * D; e += blockDim.x) {
      const int kp = e / D, c = e % D, p = tile + kp;
      float key = 0.0f;
      if (p < pools) {
        float logit[kMaxPool], k_in[kMaxPool];
#pragma unroll
        for (int j = 0; j < kMaxPool; ++j) {
          if (j < P) {
            const int pos = p * P + j;
            const __half* slot = cache + (static_cast<size_t>(table[pos / bs]) * bs + pos % bs) * shape.cache_width;
            logit[j] = __half2float(slot[gate_offset + c]) + ape[j * D + c];
            k_in[j] = __half2float(slot[shape.key_offset + c]);
          }
        }
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < kMaxPool; ++j) {
          if (j < P) mx = fmaxf(mx, logit[j]);
        }
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < kMaxPool; ++j) {
          if (j < P) sum += expf(logit[j] - mx);
        }
#pragma unroll
        for (int j = 0; j < kMaxPool; ++j) {
          if (j < P) key += expf(logit[j] - mx) / sum * k_in[j];
        }
      }
      keys[kp * (D + 1) + c] = key;
    }
    __syncthreads();
    ScoreIndexerTile(qs, wt, keys, NI, D, scale, pp, group, kHeadGroups, kPoolTile, part);
    __syncthreads();
    SumIndexerTile(part, kHeadGroups, kPoolTile, tile, pools, row);
  }
}

// One block per token.
__global__ void KpoolSelectedPositionsKernel(const int32_t* pools, const int32_t* pool_count, int select_pools,
                                             const int32_t* position, int P, int32_t* positions, int32_t* count,
                                             int stride) {
  exl3::cuda::PdlEnter();
  const int t = blockIdx.x;
  const int pos = position[t], chosen = pool_count[t];
  const int tail_first = (pos + 1) / P * P, tail = pos - tail_first + 1;
  const int32_t* mine = pools + static_cast<size_t>(t) * select_pools;
  int32_t* out = positions + static_cast<size_t>(t) * stride;
  for (int i = threadIdx.x; i < chosen * P; i += blockDim.x) out[i] = mine[i / P] * P + i % P;
  for (int i = threadIdx.x; i < tail; i += blockDim.x) out[chosen * P + i] = tail_first + i;
  if (threadIdx.x == 0) count[t] = chosen * P + tail;
}

}  // namespace

absl::Status KpoolScores(const float* q, const float* weights, float head_weight, float scale, const float* ape,
                         const KvHalf* cache_layer, const AttentionTokens& tokens, const KpoolIndexerShape& shape,
                         int first_token, int num_tokens, int blocks_per_token, float* scores, int row_length,
                         StreamHandle stream) {
  if (num_tokens == 0) return absl::OkStatus();
  if (num_tokens > 65535) return absl::InvalidArgumentError("k-pooled indexer scores: more than 65535 tokens at once");
  const int NI = shape.num_heads, D = shape.head_dim;
  if (shape.pool > kMaxPool)
    return absl::UnimplementedError(absl::StrCat("k-pooled indexer scores: pools of ", shape.pool,
                                                 " positions (the kernel holds at most ", kMaxPool, ")"));
  if (NI <= 0 || D <= 0 || shape.pool < 1 || shape.key_offset + 2 * D > shape.cache_width || blocks_per_token < 1 ||
      row_length < 1)
    return absl::InvalidArgumentError(absl::StrCat("k-pooled indexer scores: unsupported shape (heads ", NI, ", dim ",
                                                   D, ", pool ", shape.pool, ", key and gate at ", shape.key_offset,
                                                   " of a slot of ", shape.cache_width, ")"));
  const size_t bytes =
      static_cast<size_t>(NI * D + NI + kPoolTile * (D + 1) + kHeadGroups * kPoolTile) * sizeof(float);
  static size_t opted_in = 48 << 10;  // above 48 KiB a kernel must opt in
  if (bytes > opted_in) {
    const cudaError_t e =
        cudaFuncSetAttribute(KpoolScoresKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
    if (e != cudaSuccess)
      return absl::InvalidArgumentError(absl::StrCat("k-pooled indexer scores: ", bytes, " bytes of shared memory for ",
                                                     NI, " heads of ", D, ": ", cudaGetErrorString(e)));
    opted_in = bytes;
  }
  exl3::cuda::LaunchPdlWithSmem(KpoolScoresKernel, dim3(blocks_per_token, num_tokens), dim3(kThreads), bytes,
                                S(stream), q, weights, head_weight, scale, ape,
                                reinterpret_cast<const __half*>(cache_layer), tokens, shape, first_token, scores,
                                row_length);
  return LaunchStatus("k-pooled indexer scores");
}

absl::Status KpoolSelectedPositions(const int32_t* pools, const int32_t* pool_count, int select_pools,
                                    const int32_t* position, int pool, int num_tokens, int32_t* positions,
                                    int32_t* count, int stride, StreamHandle stream) {
  if (num_tokens == 0) return absl::OkStatus();
  if (pool < 1 || select_pools < 1 || stride < select_pools * pool + pool)
    return absl::InvalidArgumentError(absl::StrCat("k-pooled selection: ", select_pools, " pools of ", pool,
                                                   " and the tail in rows of ", stride));
  exl3::cuda::LaunchPdlWithSmem(KpoolSelectedPositionsKernel, dim3(num_tokens), dim3(128), 0, S(stream), pools,
                                pool_count, select_pools, position, pool, positions, count, stride);
  return LaunchStatus("k-pooled selection");
}

}  // namespace exl3::engine::cuda
