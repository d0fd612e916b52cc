#include "engine/cuda/qsa_kernels.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cuda/launch_status.cuh"
#include "kernels/cuda/launch.cuh"

namespace exl3::engine::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kScoreWarps = 8;          // blocks of one token scored by one thread block

__device__ inline double WarpSumDouble(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ inline float WarpSumFloat(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The cache slot of position p of token t's sequence.
__device__ inline int64_t SlotOf(const AttentionTokens& tk, int t, int p) {
  return static_cast<int64_t>(tk.tables[tk.table_offset[t] + p / tk.block_size]) * tk.block_size + p % tk.block_size;
}

// One thread per (token, value of the key): the query heads copied, the raw key into the cache.
__global__ void SplitIndexerKernel(const float* iqk, const int32_t* slot, int64_t T, int heads, int D, float* iq,
                                   float* key_cache) {
  exl3::cuda::PdlEnter();
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int width = (heads + 1) * D;
  if (j >= T * width) return;
  const int64_t t = j / width;
  const int c = static_cast<int>(j % width);
  if (c < heads * D) {
    iq[t * heads * D + c] = iqk[j];
  } else {
    key_cache[static_cast<int64_t>(slot[t]) * D + (c - heads * D)] = iqk[j];
  }
}

// grid (T, ceil(row_length / kScoreWarps)), block 32 · kScoreWarps: warp w takes block
// b = blockIdx.y · kScoreWarps + w of token blockIdx.x. Dynamic shared: kScoreWarps · D floats.
__global__ void BlockScoresKernel(const float* iq, const float* key_cache, AttentionTokens tk, QsaIndexerShape s,
                                  const float* k_norm, const float* block_cos, const float* block_sin, int half,
                                  float* scores, int row_length) {
  exl3::cuda::PdlEnter();
  extern __shared__ __align__(16) float qsa_keys[];
  const int t = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int b = blockIdx.y * kScoreWarps + warp;
  const int m = s.compress_ratio, D = s.head_dim;
  const int blocks = min((tk.position[t] + 1) / m, row_length);
  if (b >= blocks) return;  // whole warps leave; no block-wide barrier follows
  float* key = qsa_keys + warp * D;
  // The mean of the block's raw keys, summed in position order as the CPU sums them.
  for (int d = lane; d < D; d += 32) {
    float acc = 0.0f;
    for (int i = 0; i < m; ++i) acc += key_cache[SlotOf(tk, t, b * m + i) * D + d];
    key[d] = acc / static_cast<float>(m);
  }
  double ss = 0.0;
  for (int d = lane; d < D; d += 32) ss += static_cast<double>(key[d]) * key[d];
  ss = WarpSumDouble(ss);
  const float inv = static_cast<float>(1.0 / sqrt(ss / D + s.eps));
  for (int d = lane; d < D; d += 32) key[d] = k_norm[d] * (key[d] * inv);
  __syncwarp();
  // Half-split rope at b · m: pair (i, i + half), one lane per pair.
  const float* cs = block_cos + static_cast<int64_t>(b) * half;
  const float* sn = block_sin + static_cast<int64_t>(b) * half;
  for (int i = lane; i < half; i += 32) {
    const float x1 = key[i], x2 = key[i + half];
    key[i] = x1 * cs[i] - x2 * sn[i];
    key[i + half] = x2 * cs[i] + x1 * sn[i];
  }
  __syncwarp();
  const float* q = iq + static_cast<int64_t>(t) * s.num_heads * D;
  float sum = 0.0f;
  for (int h = 0; h < s.num_heads; ++h) {
    float dot = 0.0f;
    for (int d = lane; d < D; d += 32) dot += q[h * D + d] * key[d];
    dot = WarpSumFloat(dot);
    sum += fmaxf(dot, 0.0f);
  }
  if (lane == 0) scores[static_cast<int64_t>(t) * row_length + b] = sum * rsqrtf(static_cast<float>(D));
}

// Split-position attention (flash decoding): a thread block per (token, KV head, split) takes the
// group's G query heads over its share of the token's positions, kChunk positions at a time with a
// running max and sum per head; a split's unnormalised output and (max, sum) go to the workspace,
// or, with one split, the normalised output straight to `out`.
constexpr int kAttnThreads = 256;
constexpr int kAttnWarps = kAttnThreads / 32;
constexpr int kChunk = 64;           // positions scored at once (shared: G · kChunk scores)
constexpr int kKeyRegs = kQsaMaxHeadDim / 32;
// About two waves of blocks on an H100 / H200 (132 SMs): fewer splits leave SMs idle at batch 1.
constexpr int kTargetBlocks = 264;

__device__ inline float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// G = NH / KV query heads a KV head. grid (T, KV, splits), block kAttnThreads. Dynamic shared: q [G, D], scores [G, kChunk], running
// max / sum / correction [3, G] floats, then slots [kChunk] int64. partial: [T, NH, splits, D] then
// [T, NH, splits, 2] (max, sum) after it.
template <int G>
__global__ void __launch_bounds__(kAttnThreads)
    AttentionSplitKernel(const float* q, const __half* kv, AttentionTokens tk, const int32_t* positions,
                         const int32_t* count, int stride, int NH, int KV, int D, float scale, float* out,
                         float* partial) {
  exl3::cuda::PdlEnter();
  extern __shared__ __align__(16) float qsa_smem[];
  const int t = blockIdx.x, g = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
  const int width = 2 * KV * D;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* qs = qsa_smem;             // [G, D]
  float* sc = qs + G * D;           // [G, kChunk]
  float* run_max = sc + G * kChunk; // [G]
  float* run_sum = run_max + G;     // [G]
  float* corr = run_sum + G;        // [G]
  int64_t* slots = reinterpret_cast<int64_t*>(qsa_smem + ((G * D + G * kChunk + 3 * G + 1) & ~1));
  const float* qg = q + (static_cast<int64_t>(t) * NH + static_cast<int64_t>(g) * G) * D;
  for (int i = threadIdx.x; i < G * D; i += kAttnThreads) qs[i] = qg[i];
  for (int h = threadIdx.x; h < G; h += kAttnThreads) run_max[h] = -INFINITY, run_sum[h] = 0.0f;
  const int n = count[t];
  const int per = (n + splits - 1) / splits;
  const int begin = min(n, split * per), end = min(n, begin + per);
  float acc[G];
#pragma unroll
  for (int h = 0; h < G; ++h) acc[h] = 0.0f;
  __syncthreads();
  const int64_t row = static_cast<int64_t>(t) * stride;
  for (int c0 = begin; c0 < end; c0 += kChunk) {
    const int cnt = min(kChunk, end - c0);
    // Scores: a warp a position, its key row read once (coalesced), dotted with the G heads.
    for (int i = warp; i < cnt; i += kAttnWarps) {
      const int64_t slot = SlotOf(tk, t, positions[row + c0 + i]);
      if (lane == 0) slots[i] = slot;
      const __half* k = kv + slot * width + g * D;
      float key[kKeyRegs];
      for (int r = 0; r < kKeyRegs; ++r) {
        const int d = lane + 32 * r;
        key[r] = d < D ? __half2float(k[d]) : 0.0f;
      }
      for (int h = 0; h < G; ++h) {
        float dot = 0.0f;
        for (int r = 0; r < kKeyRegs; ++r) {
          const int d = lane + 32 * r;
          if (d < D) dot += qs[h * D + d] * key[r];
        }
        dot = WarpSumFloat(dot);
        if (lane == 0) sc[h * kChunk + i] = dot * scale;
      }
    }
    __syncthreads();
    // Per head: the chunk's max, the running max and sum moved on, the chunk's probabilities.
    for (int h = warp; h < G; h += kAttnWarps) {
      float mx = -INFINITY;
      for (int i = lane; i < cnt; i += 32) mx = fmaxf(mx, sc[h * kChunk + i]);
      mx = WarpMax(mx);
      const float old = run_max[h], now = fmaxf(old, mx);
      float sum = 0.0f;
      for (int i = lane; i < cnt; i += 32) {
        const float e = expf(sc[h * kChunk + i] - now);
        sc[h * kChunk + i] = e;
        sum += e;
      }
      sum = WarpSumFloat(sum);
      if (lane == 0) {
        const float c = expf(old - now);  // 0 while nothing was seen (old = -inf)
        corr[h] = c;
        run_sum[h] = run_sum[h] * c + sum;
        run_max[h] = now;
      }
    }
    __syncthreads();
    // Values: a thread a dimension, each position's value row read once for the G heads.
    if (threadIdx.x < D) {
      const int d = threadIdx.x;
#pragma unroll
      for (int h = 0; h < G; ++h) acc[h] *= corr[h];
      for (int i = 0; i < cnt; ++i) {
        const float v = __half2float(kv[slots[i] * width + KV * D + g * D + d]);
#pragma unroll
        for (int h = 0; h < G; ++h) acc[h] += sc[h * kChunk + i] * v;
      }
    }
    __syncthreads();  // sc and slots are the next chunk's
  }
  if (threadIdx.x >= D) return;
  const int d = threadIdx.x;
#pragma unroll
  for (int h = 0; h < G; ++h) {
    const int64_t head = static_cast<int64_t>(t) * NH + static_cast<int64_t>(g) * G + h;
    if (splits == 1) {
      out[head * D + d] = run_sum[h] > 0.0f ? acc[h] / run_sum[h] : 0.0f;
    } else {
      partial[(head * splits + split) * D + d] = acc[h];
      if (d == 0) {
        float* ms = partial + static_cast<int64_t>(gridDim.x) * NH * splits * D + (head * splits + split) * 2;
        ms[0] = run_max[h];
        ms[1] = run_sum[h];
      }
    }
  }
}

// grid (T, NH), block D threads: out[t, h] from its splits' partial outputs (as written above).
__global__ void AttentionCombineKernel(const float* partial, int T, int NH, int D, int splits, float* out) {
  exl3::cuda::PdlEnter();
  const int64_t head = static_cast<int64_t>(blockIdx.x) * NH + blockIdx.y;
  const float* ms = partial + static_cast<int64_t>(T) * NH * splits * D + head * splits * 2;
  float most = -INFINITY;
  for (int s = 0; s < splits; ++s) most = fmaxf(most, ms[2 * s]);
  float total = 0.0f, acc = 0.0f;
  const int d = threadIdx.x;
  for (int s = 0; s < splits; ++s) {
    if (ms[2 * s + 1] == 0.0f) continue;  // a split past the token's positions
    const float w = expf(ms[2 * s] - most);
    total += w * ms[2 * s + 1];
    acc += w * partial[(head * splits + s) * D + d];
  }
  out[head * D + d] = total > 0.0f ? acc / total : 0.0f;
}

size_t AttentionSharedBytes(int group, int head_dim) {
  return static_cast<size_t>((group * head_dim + group * kChunk + 3 * group + 1) & ~1) * sizeof(float) +
         kChunk * sizeof(int64_t);
}

// Splits of a token's positions: enough blocks for about kTargetBlocks, each split at least a chunk.
int AttentionSplits(int T, int KV, int stride) {
  const int most = std::max(1, (stride + kChunk - 1) / kChunk);
  const int want = (kTargetBlocks + T * KV - 1) / (T * KV);
  return std::clamp(want, 1, most);
}

}  // namespace

bool QsaAttentionShapeSupported(int num_heads, int num_kv_heads, int head_dim) {
  if (num_kv_heads < 1 || num_heads % num_kv_heads != 0 || head_dim < 1 || head_dim > kQsaMaxHeadDim) return false;
  const int group = num_heads / num_kv_heads;
  return group == 1 || group == 2 || group == 4 || group == 8 || group == 16;
}

size_t QsaAttentionWorkspaceFloats(int max_tokens, int num_heads, int num_kv_heads, int head_dim, int stride) {
  size_t most = 0;
  for (int T = 1; T <= max_tokens && T * num_kv_heads < kTargetBlocks; ++T) {
    const int splits = AttentionSplits(T, num_kv_heads, stride);
    if (splits > 1) most = std::max(most, static_cast<size_t>(T) * num_heads * splits * (head_dim + 2));
  }
  return most;
}

absl::Status QsaSplitIndexer(const float* iqk, const int32_t* slot, int T, int heads, int D, float* iq,
                             float* key_cache, StreamHandle stream) {
  if (T < 0 || heads < 1 || D < 1)
    return absl::InvalidArgumentError(absl::StrCat("QSA indexer split: ", T, " tokens of ", heads, " heads of ", D));
  const int64_t n = static_cast<int64_t>(T) * (heads + 1) * D;
  if (n == 0) return absl::OkStatus();
  exl3::cuda::LaunchPdl(SplitIndexerKernel, dim3(static_cast<unsigned>((n + kThreads - 1) / kThreads)), dim3(kThreads),
                        S(stream), iqk, slot, T, heads, D, iq, key_cache);
  return LaunchStatus("QSA indexer split");
}

absl::Status QsaBlockScores(const float* iq, const float* key_cache, const AttentionTokens& tokens,
                            const QsaIndexerShape& shape, const float* k_norm, const float* block_cos,
                            const float* block_sin, int rotary_half, int T, float* scores, int row_length,
                            StreamHandle stream) {
  if (shape.head_dim < 1 || shape.head_dim > kQsaMaxIndexerHeadDim || shape.num_heads < 1 ||
      shape.compress_ratio < 1 || rotary_half < 0 || 2 * rotary_half > shape.head_dim || T < 0)
    return absl::InvalidArgumentError(absl::StrCat("QSA block scores: ", shape.num_heads, " heads of ", shape.head_dim,
                                                   " (at most ", kQsaMaxIndexerHeadDim, "), blocks of ",
                                                   shape.compress_ratio, ", rotary half ", rotary_half));
  if (T == 0 || row_length <= 0) return absl::OkStatus();
  const dim3 grid(T, (row_length + kScoreWarps - 1) / kScoreWarps);
  const size_t bytes = static_cast<size_t>(kScoreWarps) * shape.head_dim * sizeof(float);
  exl3::cuda::LaunchPdlWithSmem(BlockScoresKernel, dim3(grid), dim3(32 * kScoreWarps), bytes, S(stream), iq, key_cache,
                                tokens, shape, k_norm, block_cos, block_sin, rotary_half, scores, row_length);
  return LaunchStatus("QSA block scores");
}

absl::Status QsaAttention(const float* q, const KvHalf* kv_cache, const AttentionTokens& tokens,
                          const int32_t* positions, const int32_t* count, int stride, int T, int NH, int KV, int D,
                          float scale, float* out, float* workspace, size_t workspace_floats, StreamHandle stream) {
  if (T < 0 || !QsaAttentionShapeSupported(NH, KV, D) || stride < 1)
    return absl::InvalidArgumentError(absl::StrCat("QSA attention: ", NH, " heads over ", KV, " KV heads of ", D,
                                                   " (1, 2, 4, 8 or 16 heads a KV head, head_dim at most ",
                                                   kQsaMaxHeadDim, "), rows of ", stride, " positions"));
  if (T == 0) return absl::OkStatus();
  const int splits = AttentionSplits(T, KV, stride);
  const size_t need = splits > 1 ? static_cast<size_t>(T) * NH * splits * (D + 2) : 0;
  if (need > workspace_floats)
    return absl::InvalidArgumentError(absl::StrCat("QSA attention: ", T, " tokens in ", splits, " splits need ", need,
                                                   " workspace floats, ", workspace_floats, " given"));
  auto* const kernel = [&] {
    switch (NH / KV) {
      case 1: return AttentionSplitKernel<1>;
      case 2: return AttentionSplitKernel<2>;
      case 4: return AttentionSplitKernel<4>;
      case 8: return AttentionSplitKernel<8>;
      default: return AttentionSplitKernel<16>;
    }
  }();
  exl3::cuda::LaunchPdlWithSmem(kernel, dim3(T, KV, splits), dim3(kAttnThreads), AttentionSharedBytes(NH / KV, D),
                                S(stream), q, reinterpret_cast<const __half*>(kv_cache), tokens, positions, count,
                                stride, NH, KV, D, scale, out, workspace);
  EXL3_RETURN_IF_ERROR(LaunchStatus("QSA attention"));
  if (splits == 1) return absl::OkStatus();
  exl3::cuda::LaunchPdl(AttentionCombineKernel, dim3(T, NH), dim3(D), S(stream), workspace, T, NH, D, splits, out);
  return LaunchStatus("QSA attention combine");
}

}  // namespace exl3::engine::cuda
