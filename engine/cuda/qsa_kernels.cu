#include "engine/cuda/qsa_kernels.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "absl/strings/str_cat.h"
#include "engine/cuda/launch_status.cuh"

namespace exl3::engine::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kScoreWarps = 8;          // blocks of one token scored by one thread block
constexpr int kAttentionThreads = 128;  // one thread block per (token, head)
// What a kernel gets without opting in (48 KiB), less room for the static reduction buffers.
constexpr int kSharedBytes = (48 << 10) - 256;

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

// Sum (or max) over the block of one float per thread (blockDim.x a multiple of 32, ≤ 1024);
// `partial` [32] shared, reusable by the next call.
template <bool kMax>
__device__ float BlockReduce(float v, float* partial) {
  for (int o = 16; o > 0; o >>= 1) {
    const float y = __shfl_xor_sync(0xffffffffu, v, o);
    v = kMax ? fmaxf(v, y) : v + y;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // partial may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  float total = partial[0];
  for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) total = kMax ? fmaxf(total, partial[w]) : total + partial[w];
  return total;
}

// grid (T, num_heads), block kAttentionThreads. Dynamic shared: q [D], then per attended position
// its probability and slot ([stride] floats, [stride] int64).
__global__ void AttentionKernel(const float* q, const __half* kv, AttentionTokens tk, const int32_t* positions,
                                const int32_t* count, int stride, int NH, int KV, int D, float scale, float* out) {
  extern __shared__ __align__(16) float qsa_smem[];
  __shared__ float partial[32];
  const int t = blockIdx.x, h = blockIdx.y, g = h / (NH / KV);
  const int width = 2 * KV * D;
  const int n = count[t];
  float* qs = qsa_smem;
  float* p = qs + D;
  int64_t* slots = reinterpret_cast<int64_t*>(qsa_smem + ((D + stride + 1) & ~1));  // 8-byte aligned
  const float* qh = q + (static_cast<int64_t>(t) * NH + h) * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) qs[d] = qh[d];
  __syncthreads();
  float local_max = -INFINITY;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t slot = SlotOf(tk, t, positions[static_cast<int64_t>(t) * stride + i]);
    slots[i] = slot;
    const __half* k = kv + slot * width + g * D;
    float s = 0.0f;
    for (int d = 0; d < D; ++d) s += qs[d] * __half2float(k[d]);
    s *= scale;
    p[i] = s;
    local_max = fmaxf(local_max, s);
  }
  const float mx = BlockReduce<true>(local_max, partial);
  float local_sum = 0.0f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const float e = expf(p[i] - mx);
    p[i] = e;
    local_sum += e;
  }
  const float inv = 1.0f / BlockReduce<false>(local_sum, partial);  // also orders p and slots for all
  float* o = out + (static_cast<int64_t>(t) * NH + h) * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.0f;
    for (int i = 0; i < n; ++i) acc += p[i] * inv * __half2float(kv[slots[i] * width + KV * D + g * D + d]);
    o[d] = acc;
  }
}

size_t AttentionSharedBytes(int head_dim, int stride) {
  return static_cast<size_t>(head_dim + stride + 1) * sizeof(float) + static_cast<size_t>(stride) * sizeof(int64_t);
}

}  // namespace

int QsaMaxAttendedPositions(int head_dim) {
  // (D + stride + 1) · 4 + stride · 8 ≤ kSharedBytes
  return (kSharedBytes - (head_dim + 1) * static_cast<int>(sizeof(float))) / 12;
}

absl::Status QsaSplitIndexer(const float* iqk, const int32_t* slot, int T, int heads, int D, float* iq,
                             float* key_cache, StreamHandle stream) {
  if (T < 0 || heads < 1 || D < 1)
    return absl::InvalidArgumentError(absl::StrCat("QSA indexer split: ", T, " tokens of ", heads, " heads of ", D));
  const int64_t n = static_cast<int64_t>(T) * (heads + 1) * D;
  if (n == 0) return absl::OkStatus();
  SplitIndexerKernel<<<static_cast<unsigned>((n + kThreads - 1) / kThreads), kThreads, 0, S(stream)>>>(
      iqk, slot, T, heads, D, iq, key_cache);
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
  BlockScoresKernel<<<grid, 32 * kScoreWarps, bytes, S(stream)>>>(iq, key_cache, tokens, shape, k_norm, block_cos,
                                                                  block_sin, rotary_half, scores, row_length);
  return LaunchStatus("QSA block scores");
}

absl::Status QsaAttention(const float* q, const KvHalf* kv_cache, const AttentionTokens& tokens,
                          const int32_t* positions, const int32_t* count, int stride, int T, int NH, int KV, int D,
                          float scale, float* out, StreamHandle stream) {
  if (T < 0 || KV < 1 || NH % KV != 0 || D < 1 || stride < 1 || stride > QsaMaxAttendedPositions(D))
    return absl::InvalidArgumentError(absl::StrCat("QSA attention: ", NH, " heads over ", KV, " KV heads of ", D,
                                                   ", rows of ", stride, " positions (at most ",
                                                   QsaMaxAttendedPositions(D), ")"));
  if (T == 0) return absl::OkStatus();
  AttentionKernel<<<dim3(T, NH), kAttentionThreads, AttentionSharedBytes(D, stride), S(stream)>>>(
      q, reinterpret_cast<const __half*>(kv_cache), tokens, positions, count, stride, NH, KV, D, scale, out);
  return LaunchStatus("QSA attention");
}

}  // namespace exl3::engine::cuda
