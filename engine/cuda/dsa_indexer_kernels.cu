#include "engine/cuda/dsa_indexer_kernels.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "engine/cuda/launch_status.cuh"
#include "engine/cuda/block_reduce.cuh"
#include "engine/cuda/indexer_tile_scores.cuh"
#include "kernels/cuda/launch.cuh"

namespace exl3::engine::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kScorePositions = 32;  // positions per tile of the score kernel
constexpr int kScoreHeadLanes = 4;   // threads per position, each summing every 4th head
constexpr int kTopkThreads = 1024;

__global__ void LayerNormKernel(float* x, const float* w, const float* b, int n, float eps) {
  exl3::cuda::PdlEnter();
  __shared__ double partial[32];
  float* v = x + static_cast<size_t>(blockIdx.x) * n;
  double s = 0.0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += v[i];
  const double mean = BlockSumDouble(s, partial) / n;
  double q = 0.0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) q += (v[i] - mean) * (v[i] - mean);
  const double var = BlockSumDouble(q, partial) / n;
  const float inv = static_cast<float>(1.0 / sqrt(var + eps));
  const float m = static_cast<float>(mean);
  for (int i = threadIdx.x; i < n; i += blockDim.x) v[i] = __fadd_rn(__fmul_rn(__fmul_rn(v[i] - m, inv), w[i]), b[i]);
}

__global__ void WriteRowsKernel(const float* x, int n, const int32_t* slot, __half* cache, int width, int offset) {
  exl3::cuda::PdlEnter();
  const float* v = x + static_cast<size_t>(blockIdx.x) * n;
  __half* s = cache + static_cast<size_t>(slot[blockIdx.x]) * width + offset;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s[i] = __float2half_rn(v[i]);
}

// grid (blocks_per_token, tokens); kScorePositions * kScoreHeadLanes threads. Shared: the token's
// queries [NI, DI], its head weights [NI], a tile of keys [P, DI + 1] (padded: conflict-free
// reads across positions) and the head lanes' partial sums [lanes, P].
__global__ void IndexerScoresKernel(const float* q, const float* weights, float head_weight, float scale,
                                    const __half* cache, AttentionTokens at, IndexerShape shape, int first_token,
                                    float* scores, int row_length) {
  exl3::cuda::PdlEnter();
  extern __shared__ float smem[];
  const int NI = shape.num_heads, DI = shape.head_dim, P = kScorePositions;
  float* qs = smem;
  float* wt = qs + NI * DI;
  float* keys = wt + NI;
  float* part = keys + P * (DI + 1);
  const int t = first_token + blockIdx.y;
  const int n = min(at.position[t] + 1, row_length);
  const int32_t* table = at.tables + at.table_offset[t];
  const int bs = at.block_size;
  LoadIndexerQuery(q, weights, head_weight, t, NI, DI, qs, wt);
  float* row = scores + static_cast<size_t>(blockIdx.y) * row_length;
  const int pp = threadIdx.x % P, lane_group = threadIdx.x / P;
  for (int tile = blockIdx.x * P; tile < n; tile += gridDim.x * P) {
    __syncthreads();  // queries loaded; the previous tile's keys and partials consumed
    for (int e = threadIdx.x; e < P * DI; e += blockDim.x) {
      const int p = e / DI, d = e % DI, j = tile + p;
      float k = 0.0f;
      if (j < n) {
        const size_t slot = static_cast<size_t>(table[j / bs]) * bs + j % bs;
        k = __half2float(cache[slot * shape.cache_width + shape.key_offset + d]);
      }
      keys[p * (DI + 1) + d] = k;
    }
    __syncthreads();
    ScoreIndexerTile(qs, wt, keys, NI, DI, scale, pp, lane_group, kScoreHeadLanes, P, part);
    __syncthreads();
    SumIndexerTile(part, kScoreHeadLanes, P, tile, n, row);
  }
}

// The tensor-core cut: a tile of 64 positions; S[heads, 64] = q[heads, DI] · keys[64, DI]ᵀ in
// 16 x 16 fragments (8 warps), then one thread per position sums its heads in order as the CPU
// engine does. Shared: q and the key tile in fp16 (rows padded by 8 halves), S in fp32.
namespace wmma = nvcuda::wmma;
constexpr int kTcScorePositions = 64;
constexpr int kTcPad = 8;

struct IndexerTcSmem {
  int q, keys, s, w, bytes, ld, s_ld;
  __host__ __device__ static int Align(int b) { return (b + 127) / 128 * 128; }
  __host__ __device__ IndexerTcSmem(int NI, int DI) {
    ld = DI + kTcPad;
    s_ld = kTcScorePositions + 4;
    q = 0;
    keys = Align(q + NI * ld * 2);
    s = Align(keys + kTcScorePositions * ld * 2);
    w = Align(s + NI * s_ld * 4);
    bytes = Align(w + NI * 4);
  }
};

__global__ void IndexerScoresTcKernel(const float* q, const float* weights, float head_weight, float scale,
                                      const __half* cache, AttentionTokens at, IndexerShape shape, int first_token,
                                      float* scores, int row_length) {
  exl3::cuda::PdlEnter();
  extern __shared__ __align__(128) unsigned char ix_smem[];
  const int NI = shape.num_heads, DI = shape.head_dim, P = kTcScorePositions;
  const IndexerTcSmem lay(NI, DI);
  __half* qs = reinterpret_cast<__half*>(ix_smem + lay.q);
  __half* keys = reinterpret_cast<__half*>(ix_smem + lay.keys);
  float* sv = reinterpret_cast<float*>(ix_smem + lay.s);
  float* wt = reinterpret_cast<float*>(ix_smem + lay.w);
  const int t = first_token + blockIdx.y;
  const int n = min(at.position[t] + 1, row_length);
  const int32_t* table = at.tables + at.table_offset[t];
  const int bs = at.block_size;
  for (int e = threadIdx.x; e < NI * DI; e += blockDim.x)
    qs[(e / DI) * lay.ld + e % DI] = __float2half_rn(q[static_cast<size_t>(t) * NI * DI + e]);
  for (int h = threadIdx.x; h < NI; h += blockDim.x) wt[h] = weights[static_cast<size_t>(t) * NI + h] * head_weight;
  float* row = scores + static_cast<size_t>(blockIdx.y) * row_length;
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int head_frags = NI / 16, frags = head_frags * (P / 16), vecs = DI / 8;
  for (int tile = blockIdx.x * P; tile < n; tile += gridDim.x * P) {
    __syncthreads();  // q loaded; the previous tile's keys and S consumed
    for (int e = threadIdx.x; e < P * vecs; e += blockDim.x) {
      const int p = e / vecs, v = e % vecs, j = tile + p;
      uint4 x = make_uint4(0, 0, 0, 0);
      if (j < n) {
        const size_t slot = static_cast<size_t>(table[j / bs]) * bs + j % bs;
        x = *reinterpret_cast<const uint4*>(cache + slot * shape.cache_width + shape.key_offset + v * 8);
      }
      *reinterpret_cast<uint4*>(keys + p * lay.ld + v * 8) = x;
    }
    __syncthreads();
    for (int f = warp; f < frags; f += warps) {
      const int hf = f % head_frags, pf = f / head_frags;
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
      wmma::fill_fragment(c, 0.0f);
      for (int kc = 0; kc < DI / 16; ++kc) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b;
        wmma::load_matrix_sync(a, qs + hf * 16 * lay.ld + kc * 16, lay.ld);
        wmma::load_matrix_sync(b, keys + pf * 16 * lay.ld + kc * 16, lay.ld);
        wmma::mma_sync(c, a, b, c);
      }
      wmma::store_matrix_sync(sv + hf * 16 * lay.s_ld + pf * 16, c, lay.s_ld, wmma::mem_row_major);
    }
    __syncthreads();
    if (threadIdx.x < P && tile + threadIdx.x < n) {
      float s = 0.0f;
      for (int h = 0; h < NI; ++h) s += wt[h] * fmaxf(sv[h * lay.s_ld + threadIdx.x] * scale, 0.0f);
      row[tile + threadIdx.x] = s;
    }
  }
}

// Orders floats as unsigned integers (larger float, larger key); -0 maps to +0's key.
__device__ inline uint32_t OrderKey(float x) {
  const uint32_t u = __float_as_uint(x + 0.0f);
  return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
}

// Exclusive prefix sum of v over the block (blockDim.x a multiple of 32); *total gets the sum.
// tmp: 33 ints of shared memory.
__device__ int BlockExclusiveScan(int v, int* tmp, int* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  int incl = v;
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == 31) tmp[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const int x = lane < warps ? tmp[lane] : 0;
    int xi = x;
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, xi, o);
      if (lane >= o) xi += y;
    }
    if (lane < warps) tmp[lane] = xi - x;  // exclusive over the warps
    if (lane == 31) tmp[32] = xi;
  }
  __syncthreads();
  const int result = tmp[warp] + incl - v;
  *total = tmp[32];
  __syncthreads();  // tmp is reused by the next call
  return result;
}

// One block per query token: radix selection (four 8-bit passes) of the topk-th highest key, then
// one ordered pass that takes every higher key and the lowest candidates of the equal ones.
__global__ void IndexerTopkKernel(const float* scores, int row_length, const int32_t* position, int first_token,
                                  int topk, int32_t* selected, int32_t* count, int pool) {
  exl3::cuda::PdlEnter();
  __shared__ int hist[256];
  __shared__ uint32_t prefix_s;
  __shared__ int need_s;
  __shared__ int scan_tmp[33];
  const int t = first_token + blockIdx.x;
  const int n = min((position[t] + 1) / pool, row_length);
  int32_t* out = selected + static_cast<size_t>(t) * topk;
  if (n <= topk) {  // it sees no more than top-k candidates: all of them
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = i;
    if (threadIdx.x == 0) count[t] = n;
    return;
  }
  const float* row = scores + static_cast<size_t>(blockIdx.x) * row_length;
  uint32_t prefix = 0, mask = 0;
  int need = topk;  // how many of the keys matching prefix (from the top) are still to take
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
      const uint32_t k = OrderKey(row[j]);
      if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 255u], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int above = 0, b = 255;
      while (b > 0 && above + hist[b] < need) above += hist[b--];  // the bins hold ≥ need keys
      prefix_s = prefix | (static_cast<uint32_t>(b) << shift);
      need_s = need - above;
    }
    __syncthreads();
    prefix = prefix_s;
    need = need_s;
    mask |= 255u << shift;
    __syncthreads();  // prefix_s and need_s are rewritten by the next pass
  }
  // prefix: the topk-th highest key; take every higher one and the first `need` equal ones.
  int equal_before = 0, taken_before = 0;
  for (int base = 0; base < n; base += blockDim.x) {
    const int j = base + threadIdx.x;
    const uint32_t k = j < n ? OrderKey(row[j]) : 0u;
    const bool higher = j < n && k > prefix, equal = j < n && k == prefix;
    int equal_total = 0, taken_total = 0;
    const int equal_rank = equal_before + BlockExclusiveScan(equal ? 1 : 0, scan_tmp, &equal_total);
    const bool take = higher || (equal && equal_rank < need);
    const int slot = taken_before + BlockExclusiveScan(take ? 1 : 0, scan_tmp, &taken_total);
    if (take) out[slot] = j;
    equal_before += equal_total;
    taken_before += taken_total;
  }
  if (threadIdx.x == 0) count[t] = topk;
}

}  // namespace

absl::Status LayerNormRows(float* x, const float* w, const float* b, int rows, int n, float eps, StreamHandle stream) {
  if (rows == 0) return absl::OkStatus();
  exl3::cuda::LaunchPdlWithSmem(LayerNormKernel, dim3(rows), dim3(kThreads), 0, S(stream), x, w, b, n, eps);
  return LaunchStatus("indexer layernorm");
}

absl::Status WriteRowsToCache(const float* x, int T, int n, const int32_t* slot, KvHalf* cache_layer, int width,
                              int offset, StreamHandle stream) {
  if (T == 0) return absl::OkStatus();
  if (offset + n > width) return absl::InvalidArgumentError("cache row write: past the end of the slot");
  exl3::cuda::LaunchPdlWithSmem(WriteRowsKernel, dim3(T), dim3(128), 0, S(stream), x, n, slot,
                                reinterpret_cast<__half*>(cache_layer), width, offset);
  return LaunchStatus("indexer key cache write");
}

bool IndexerTensorCoresSupport(const IndexerShape& shape) {
  return shape.num_heads > 0 && shape.num_heads % 16 == 0 && shape.head_dim > 0 && shape.head_dim % 16 == 0 &&
         shape.key_offset % 8 == 0 && shape.cache_width % 8 == 0 &&
         IndexerTcSmem(shape.num_heads, shape.head_dim).bytes <= (227 << 10);
}

absl::Status IndexerScores(const float* q, const float* weights, float head_weight, float scale,
                           const KvHalf* cache_layer, const AttentionTokens& tokens, const IndexerShape& shape,
                           int first_token, int num_tokens, int blocks_per_token, float* scores, int row_length,
                           StreamHandle stream, bool tensor_cores) {
  if (num_tokens == 0) return absl::OkStatus();
  if (num_tokens > 65535) return absl::InvalidArgumentError("indexer scores: more than 65535 tokens at once");
  if (shape.num_heads <= 0 || shape.head_dim <= 0 || shape.key_offset + shape.head_dim > shape.cache_width ||
      blocks_per_token < 1 || row_length < 1)
    return absl::InvalidArgumentError(absl::StrCat("indexer scores: unsupported shape (heads ", shape.num_heads,
                                                   ", dim ", shape.head_dim, ", key at ", shape.key_offset,
                                                   " of a slot of ", shape.cache_width, ")"));
  if (tensor_cores) {
    if (!IndexerTensorCoresSupport(shape))
      return absl::InvalidArgumentError(absl::StrCat("indexer scores on tensor cores: ", shape.num_heads, " heads of ",
                                                     shape.head_dim, " (multiples of 16), key at ", shape.key_offset,
                                                     " of a slot of ", shape.cache_width, " (multiples of 8)"));
    const size_t bytes = IndexerTcSmem(shape.num_heads, shape.head_dim).bytes;
    static size_t tc_opted_in = 48 << 10;  // above 48 KiB a kernel must opt in
    if (bytes > tc_opted_in) {
      const cudaError_t e = cudaFuncSetAttribute(reinterpret_cast<const void*>(IndexerScoresTcKernel),
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
      if (e != cudaSuccess)
        return absl::InvalidArgumentError(absl::StrCat("indexer scores: ", bytes, " bytes of shared memory: ",
                                                       cudaGetErrorString(e)));
      tc_opted_in = bytes;
    }
    const int blocks = std::max(1, (blocks_per_token * kScorePositions + kTcScorePositions - 1) / kTcScorePositions);
    exl3::cuda::LaunchPdlWithSmem(IndexerScoresTcKernel, dim3(blocks, num_tokens), dim3(256), bytes, S(stream), q,
                                  weights, head_weight, scale, reinterpret_cast<const __half*>(cache_layer), tokens,
                                  shape, first_token, scores, row_length);
    return LaunchStatus("indexer scores (tensor cores)");
  }
  const int P = kScorePositions, DI = shape.head_dim, NI = shape.num_heads;
  const size_t bytes = static_cast<size_t>(NI * DI + NI + P * (DI + 1) + kScoreHeadLanes * P) * sizeof(float);
  static size_t opted_in = 48 << 10;  // above 48 KiB a kernel must opt in
  if (bytes > opted_in) {
    const cudaError_t e =
        cudaFuncSetAttribute(IndexerScoresKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
    if (e != cudaSuccess)
      return absl::InvalidArgumentError(absl::StrCat("indexer scores: ", bytes, " bytes of shared memory for ", NI,
                                                     " heads of ", DI, ": ", cudaGetErrorString(e)));
    opted_in = bytes;
  }
  exl3::cuda::LaunchPdlWithSmem(
      IndexerScoresKernel, dim3(blocks_per_token, num_tokens), dim3(P * kScoreHeadLanes), bytes, S(stream), q, weights,
      head_weight, scale, reinterpret_cast<const __half*>(cache_layer), tokens, shape, first_token, scores, row_length);
  return LaunchStatus("indexer scores");
}

absl::Status IndexerTopk(const float* scores, int row_length, const int32_t* position, int first_token,
                         int num_tokens, int topk, int32_t* selected, int32_t* count, StreamHandle stream, int pool) {
  if (num_tokens == 0) return absl::OkStatus();
  if (topk < 1) return absl::InvalidArgumentError(absl::StrCat("indexer top-k of ", topk));
  if (pool < 1) return absl::InvalidArgumentError(absl::StrCat("indexer top-k over pools of ", pool));
  exl3::cuda::LaunchPdlWithSmem(IndexerTopkKernel, dim3(num_tokens), dim3(kTopkThreads), 0, S(stream), scores,
                                row_length, position, first_token, topk, selected, count, pool);
  return LaunchStatus("indexer top-k");
}

}  // namespace exl3::engine::cuda
