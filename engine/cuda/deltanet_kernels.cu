#include "engine/cuda/deltanet_kernels.h"

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "engine/cuda/delta_rule_kernels.h"
#include "engine/cuda/launch_status.cuh"
#include "engine/cuda/recurrent_chunks.cuh"
#include "kernels/cuda/launch.cuh"

namespace exl3::engine::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float Sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float Silu(float x) { return x * Sigmoid(x); }
// torch's softplus (beta 1, threshold 20), as engine/cpu/linear_attention/gated_deltanet.cc.
__device__ __forceinline__ float Softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The qkvz column of conv channel c (conv order: q of every key head, k of every key head, v of
// every value head; in_proj_qkvz's: per key head q, k, v of its value heads, z of them).
__device__ __forceinline__ int QkvzColumn(const DeltaNetDims& d, int c) {
  const int DK = d.key_head_dim, KD = d.key_dim();
  const int ratio = d.num_value_heads / d.num_key_heads, rv = ratio * d.value_head_dim;
  const int per = 2 * DK + 2 * rv;
  if (c < KD) return (c / DK) * per + c % DK;
  if (c < 2 * KD) return ((c - KD) / DK) * per + DK + (c - KD) % DK;
  c -= 2 * KD;
  return (c / rv) * per + 2 * DK + c % rv;
}

// The qkvz column of element e of value head h's z.
__device__ __forceinline__ int ZColumn(const DeltaNetDims& d, int h, int e) {
  const int ratio = d.num_value_heads / d.num_key_heads, rv = ratio * d.value_head_dim;
  const int per = 2 * d.key_head_dim + 2 * rv;
  return (h / ratio) * per + 2 * d.key_head_dim + rv + (h % ratio) * d.value_head_dim + e;
}

// Input i of chunk `c`'s conv window for channel `ch` (qkvz column `col`): the conv state's input
// i for i < K - 1, else the chunk's token i - (K - 1).
__device__ __forceinline__ float WindowInput(const float* qkvz, const DeltaNetDims& d,
                                             const float* prev_conv, const RecurrentChunk& c, int i, int ch,
                                             int col) {
  const int K = d.conv_kernel;
  if (i < K - 1) return prev_conv[static_cast<size_t>(i) * d.conv_channels() + ch];
  return qkvz[static_cast<size_t>(c.first + i - (K - 1)) * d.qkvz_width() + col];
}

// grid ceil(n * C / kThreads), block kThreads: one thread per (token, channel) of rows
// [first, first + n). qkvz [tokens, qkvz_width]; conv_weight [C, K]; conv_out [tokens, C]; the
// conv state read from each token's chunk's read_row.
__global__ void ConvKernel(const float* __restrict__ qkvz, const float* __restrict__ conv_weight,
                           DeltaNetDims d, RecurrentChunks chunks, int first, int n,
                           float* __restrict__ conv_out) {
  exl3::cuda::PdlEnter();
  const int C = d.conv_channels(), K = d.conv_kernel;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (item >= static_cast<int64_t>(n) * C) return;
  const int t = first + static_cast<int>(item / C), ch = static_cast<int>(item % C);
  const RecurrentChunk c = LoadChunk(chunks, chunks.chunk_of[t]);
  const float* prev = chunks.states + static_cast<size_t>(c.read_row) * chunks.row_floats;
  const int j = t - c.first, col = QkvzColumn(d, ch);
  const float* w = conv_weight + static_cast<size_t>(ch) * K;
  float acc = 0.f;
  for (int i = 0; i < K; ++i) acc += w[i] * WindowInput(qkvz, d, prev, c, j + i, ch, col);
  conv_out[static_cast<size_t>(t) * C + ch] = Silu(acc);
}

// grid ceil(num_chunks * C / kThreads), block kThreads: one thread per (chunk, channel). The
// chunk's new conv state [K - 1, C] at its write_row: the K - 1 window inputs before input
// tokens + K - 1; a verify chunk's kept state k (after its first f = first_kept_token + k + 1
// tokens) those before input f + K - 1, at its row.
__global__ void ConvStateKernel(const float* __restrict__ qkvz, DeltaNetDims d,
                                RecurrentChunks chunks, int first_chunk, int num_chunks) {
  exl3::cuda::PdlEnter();
  const int C = d.conv_channels(), K = d.conv_kernel;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (item >= static_cast<int64_t>(num_chunks) * C) return;
  const int ch = static_cast<int>(item % C);
  const RecurrentChunk c = LoadChunk(chunks, first_chunk + static_cast<int>(item / C));
  const float* prev = StateRow(chunks, c.read_row);
  const int col = QkvzColumn(d, ch);
  for (int k = 0; k < c.kept_states; ++k) {
    float* next = StateRow(chunks, c.KeptRow(k));
    const int folded = c.first_kept_token() + k + 1;  // the chunk's tokens in that state
    for (int i = 0; i < K - 1; ++i)
      next[static_cast<size_t>(i) * C + ch] = WindowInput(qkvz, d, prev, c, folded + i, ch, col);
  }
}

// x ← x / sqrt(Σx² + 1e-6) · scale over one head of `len` floats, by one warp.
__device__ void WarpL2Normalize(float* x, int len, float scale, int lane) {
  float ss = 0.f;
  for (int i = lane; i < len; i += 32) ss += x[i] * x[i];
  ss = WarpSum(ss);
  const float inv = rsqrtf(ss + 1e-6f) * scale;
  __syncwarp();
  for (int i = lane; i < len; i += 32) x[i] *= inv;
}

// grid ceil(n * num_key_heads / 8), block 256: one warp per (token, key head): its q and k
// normalised, β and the decay of its value heads.
__global__ void NormAndGatesKernel(float* __restrict__ conv_out, const float* __restrict__ ba,
                                   const float* __restrict__ neg_a,
                                   const float* __restrict__ dt_bias, DeltaNetDims d, int first,
                                   int n, float* __restrict__ beta, float* __restrict__ decay) {
  exl3::cuda::PdlEnter();
  const int lane = threadIdx.x % 32;
  const int w = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (w >= n * d.num_key_heads) return;
  const int t = first + w / d.num_key_heads, g = w % d.num_key_heads;
  const int DK = d.key_head_dim, NV = d.num_value_heads;
  const int ratio = NV / d.num_key_heads;
  float* row = conv_out + static_cast<size_t>(t) * d.conv_channels();
  WarpL2Normalize(row + g * DK, DK, rsqrtf(static_cast<float>(DK)), lane);
  WarpL2Normalize(row + d.key_dim() + g * DK, DK, 1.f, lane);
  const float* bat = ba + static_cast<size_t>(t) * 2 * NV + g * 2 * ratio;
  for (int r = lane; r < ratio; r += 32) {
    const int h = g * ratio + r;
    beta[static_cast<size_t>(t) * NV + h] = Sigmoid(bat[r]);
    decay[static_cast<size_t>(t) * NV + h] = expf(neg_a[h] * Softplus(bat[ratio + r] + dt_bias[h]));
  }
}

// grid ceil(n * num_value_heads / 8), block 256: one warp per (token, value head).
__global__ void GatedNormKernel(float* __restrict__ core, const float* __restrict__ qkvz,
                                const float* __restrict__ w, DeltaNetDims d, float eps,
                                DeltaNetOutputGate gate, int first, int n) {
  exl3::cuda::PdlEnter();
  const int lane = threadIdx.x % 32;
  const int item = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (item >= n * d.num_value_heads) return;
  const int t = first + item / d.num_value_heads, h = item % d.num_value_heads;
  const int DV = d.value_head_dim;
  float* o = core + (static_cast<size_t>(t) * d.num_value_heads + h) * DV;
  const float* z = qkvz + static_cast<size_t>(t) * d.qkvz_width();
  float ss = 0.f;
  for (int e = lane; e < DV; e += 32) ss += o[e] * o[e];
  ss = WarpSum(ss);
  const float inv = rsqrtf(ss / DV + eps);
  __syncwarp();
  for (int e = lane; e < DV; e += 32) {
    const float zv = z[ZColumn(d, h, e)];
    o[e] = w[e] * (o[e] * inv) * (gate == DeltaNetOutputGate::kSigmoid ? Sigmoid(zv) : Silu(zv));
  }
}

// grid ceil(n * (qkvz_width + 2 * NV) / kThreads), block kThreads: one thread per (token, grouped
// column) of qkvz, then of ba.
__global__ void GroupSeparateKernel(const float* __restrict__ qkv, const float* __restrict__ z,
                                    const float* __restrict__ b, const float* __restrict__ a,
                                    DeltaNetDims d, int first, int n, float* __restrict__ qkvz,
                                    float* __restrict__ ba) {
  exl3::cuda::PdlEnter();
  const int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int W = d.qkvz_width(), NV = d.num_value_heads, width = W + 2 * NV;
  if (item >= static_cast<int64_t>(n) * width) return;
  const size_t t = static_cast<size_t>(first) + static_cast<size_t>(item / width);
  const int col = static_cast<int>(item % width);
  const int DK = d.key_head_dim, KD = d.key_dim();
  const int ratio = NV / d.num_key_heads, rv = ratio * d.value_head_dim;
  if (col < W) {
    const int per = 2 * DK + 2 * rv, g = col / per, off = col % per;
    const float* qkv_row = qkv + t * d.conv_channels();
    float v;
    if (off < DK) {
      v = qkv_row[g * DK + off];
    } else if (off < 2 * DK) {
      v = qkv_row[KD + g * DK + off - DK];
    } else if (off < 2 * DK + rv) {
      v = qkv_row[2 * KD + g * rv + off - 2 * DK];
    } else {
      v = z[t * d.value_dim() + g * rv + off - 2 * DK - rv];
    }
    qkvz[t * W + col] = v;
    return;
  }
  const int c = col - W, g = c / (2 * ratio), off = c % (2 * ratio);
  ba[t * 2 * NV + c] = off < ratio ? b[t * NV + g * ratio + off] : a[t * NV + g * ratio + off - ratio];
}

unsigned Blocks(int64_t items, int per_block) {
  return static_cast<unsigned>((items + per_block - 1) / per_block);
}

}  // namespace

absl::Status DeltaNetConv(const float* qkvz, const float* conv_weight, const DeltaNetDims& dims,
                          const RecurrentChunks& chunks, int first, int n, float* conv_out,
                          StreamHandle stream) {
  if (n <= 0) return absl::OkStatus();
  exl3::cuda::LaunchPdl(ConvKernel, dim3(Blocks(static_cast<int64_t>(n) * dims.conv_channels(), kThreads)),
                        dim3(kThreads), S(stream), qkvz, conv_weight, dims, chunks, first, n, conv_out);
  return LaunchStatus("DeltaNetConv");
}

absl::Status DeltaNetConvState(const float* qkvz, const DeltaNetDims& dims,
                               const RecurrentChunks& chunks, int first_chunk, int num_chunks,
                               StreamHandle stream) {
  if (num_chunks <= 0 || dims.conv_kernel < 2) return absl::OkStatus();
  exl3::cuda::LaunchPdl(ConvStateKernel,
                        dim3(Blocks(static_cast<int64_t>(num_chunks) * dims.conv_channels(), kThreads)), dim3(kThreads),
                        S(stream), qkvz, dims, chunks, first_chunk, num_chunks);
  return LaunchStatus("DeltaNetConvState");
}

absl::Status DeltaNetNormAndGates(float* conv_out, const float* ba, const float* neg_a,
                                  const float* dt_bias, const DeltaNetDims& dims, int first, int n,
                                  float* beta, float* decay, StreamHandle stream) {
  if (n <= 0) return absl::OkStatus();
  exl3::cuda::LaunchPdl(NormAndGatesKernel, dim3(Blocks(static_cast<int64_t>(n) * dims.num_key_heads, kThreads / 32)),
                        dim3(kThreads), S(stream), conv_out, ba, neg_a, dt_bias, dims, first, n, beta, decay);
  return LaunchStatus("DeltaNetNormAndGates");
}

namespace {

DeltaRuleShape DeltaNetDeltaRuleShape(const DeltaNetDims& d) {
  DeltaRuleShape sh;
  sh.num_heads = d.num_value_heads;
  sh.heads_per_key_head = d.num_key_heads > 0 ? d.num_value_heads / d.num_key_heads : 0;
  sh.key_head_dim = d.key_head_dim;
  sh.value_head_dim = d.value_head_dim;
  sh.row_floats = d.conv_channels();
  sh.q_at = 0;
  sh.k_at = d.key_dim();
  sh.v_at = 2 * d.key_dim();
  sh.state_at = d.conv_state_floats();
  return sh;
}

}  // namespace

absl::Status DeltaNetRecurrence(const float* conv_out, const float* beta, const float* decay,
                                const DeltaNetDims& dims, const RecurrentChunks& chunks,
                                int first_chunk, int num_chunks, float* core, StreamHandle stream) {
  return DeltaRuleRecurrence(conv_out, beta, decay, DeltaRuleDecay::kPerHead,
                             DeltaNetDeltaRuleShape(dims), chunks, first_chunk, num_chunks, core,
                             stream);
}

absl::Status DeltaNetGatedNorm(float* core, const float* qkvz, const float* norm_weight,
                               const DeltaNetDims& dims, float eps, DeltaNetOutputGate gate, int first, int n,
                               StreamHandle stream) {
  if (n <= 0) return absl::OkStatus();
  exl3::cuda::LaunchPdl(GatedNormKernel, dim3(Blocks(static_cast<int64_t>(n) * dims.num_value_heads, kThreads / 32)),
                        dim3(kThreads), S(stream), core, qkvz, norm_weight, dims, eps, gate, first, n);
  return LaunchStatus("DeltaNetGatedNorm");
}

absl::Status DeltaNetGroupSeparateProjections(const float* qkv, const float* z, const float* b, const float* a,
                                              const DeltaNetDims& dims, int first, int n, float* qkvz,
                                              float* ba, StreamHandle stream) {
  if (n <= 0) return absl::OkStatus();
  const int64_t items = static_cast<int64_t>(n) * (dims.qkvz_width() + 2 * dims.num_value_heads);
  exl3::cuda::LaunchPdl(GroupSeparateKernel, dim3(Blocks(items, kThreads)), dim3(kThreads), S(stream), qkv, z, b, a,
                        dims, first, n, qkvz, ba);
  return LaunchStatus("DeltaNetGroupSeparateProjections");
}

absl::Status CheckDeltaNetDims(const DeltaNetDims& dims) {
  if (dims.num_key_heads <= 0 || dims.num_value_heads % dims.num_key_heads != 0)
    return absl::InvalidArgumentError(absl::StrCat("DeltaNet: ", dims.num_value_heads,
                                                   " value heads over ", dims.num_key_heads,
                                                   " key heads"));
  return CheckDeltaRuleShape(DeltaNetDeltaRuleShape(dims));
}

}  // namespace exl3::engine::cuda
