#include "engine/cuda/deltanet_kernels.h"

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "engine/cuda/launch_status.cuh"

namespace exl3::engine::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float Sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float Silu(float x) { return x * Sigmoid(x); }
// torch's softplus (beta 1, threshold 20), as engine/gated_deltanet.cc.
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

struct Chunk {
  int first, tokens, read_row, write_row;
};

__device__ __forceinline__ Chunk LoadChunk(const RecurrentChunks& ch, int c) {
  const int32_t* e = ch.table + static_cast<size_t>(c) * kRecurrentChunkInts;
  return Chunk{e[0], e[1], e[2], e[3]};
}

// Input i of chunk `c`'s conv window for channel `ch` (qkvz column `col`): the conv state's input
// i for i < K - 1, else the chunk's token i - (K - 1).
__device__ __forceinline__ float WindowInput(const float* qkvz, const DeltaNetDims& d,
                                             const float* prev_conv, const Chunk& c, int i, int ch,
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
  const int C = d.conv_channels(), K = d.conv_kernel;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (item >= static_cast<int64_t>(n) * C) return;
  const int t = first + static_cast<int>(item / C), ch = static_cast<int>(item % C);
  const Chunk c = LoadChunk(chunks, chunks.chunk_of[t]);
  const float* prev = chunks.states + static_cast<size_t>(c.read_row) * chunks.row_floats;
  const int j = t - c.first, col = QkvzColumn(d, ch);
  const float* w = conv_weight + static_cast<size_t>(ch) * K;
  float acc = 0.f;
  for (int i = 0; i < K; ++i) acc += w[i] * WindowInput(qkvz, d, prev, c, j + i, ch, col);
  conv_out[static_cast<size_t>(t) * C + ch] = Silu(acc);
}

// grid ceil(num_chunks * C / kThreads), block kThreads: one thread per (chunk, channel). The
// chunk's new conv state [K - 1, C] at its write_row.
__global__ void ConvStateKernel(const float* __restrict__ qkvz, DeltaNetDims d,
                                RecurrentChunks chunks, int first_chunk, int num_chunks) {
  const int C = d.conv_channels(), K = d.conv_kernel;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (item >= static_cast<int64_t>(num_chunks) * C) return;
  const int ch = static_cast<int>(item % C);
  const Chunk c = LoadChunk(chunks, first_chunk + static_cast<int>(item / C));
  const float* prev = chunks.states + static_cast<size_t>(c.read_row) * chunks.row_floats;
  float* next = chunks.states + static_cast<size_t>(c.write_row) * chunks.row_floats;
  const int col = QkvzColumn(d, ch);
  for (int i = 0; i < K - 1; ++i)
    next[static_cast<size_t>(i) * C + ch] = WindowInput(qkvz, d, prev, c, c.tokens + i, ch, col);
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

int RecurrenceThreads(const DeltaNetDims& d) { return (d.value_head_dim + 31) / 32 * 32; }
size_t RecurrenceSharedBytes(const DeltaNetDims& d) {
  return (static_cast<size_t>(d.key_head_dim) * d.value_head_dim + 2 * d.key_head_dim) *
         sizeof(float);
}

// grid num_chunks * num_value_heads, block RecurrenceThreads (thread e owns column e of S),
// dynamic shared memory RecurrenceSharedBytes: S [DK, DV], then the token's k [DK] and q [DK].
// Each thread reads and writes only its own column of S; the syncs guard k and q.
__global__ void RecurrenceKernel(const float* __restrict__ conv_out, const float* __restrict__ beta,
                                 const float* __restrict__ decay, DeltaNetDims d,
                                 RecurrentChunks chunks, int first_chunk, float* __restrict__ core) {
  extern __shared__ float smem[];
  const int NV = d.num_value_heads, DK = d.key_head_dim, DV = d.value_head_dim;
  const int C = d.conv_channels(), KD = d.key_dim();
  const int h = blockIdx.x % NV, g = h / (NV / d.num_key_heads);
  const Chunk c = LoadChunk(chunks, first_chunk + static_cast<int>(blockIdx.x / NV));
  const size_t head = d.conv_state_floats() + static_cast<size_t>(h) * DK * DV;
  const float* prev = chunks.states + static_cast<size_t>(c.read_row) * chunks.row_floats + head;
  float* next = chunks.states + static_cast<size_t>(c.write_row) * chunks.row_floats + head;
  float* S = smem;
  float* k = S + static_cast<size_t>(DK) * DV;
  float* q = k + DK;
  const int e = threadIdx.x;
  for (int i = threadIdx.x; i < DK * DV; i += blockDim.x) S[i] = prev[i];
  for (int j = 0; j < c.tokens; ++j) {
    const size_t t = static_cast<size_t>(c.first + j);
    const float* row = conv_out + t * C;
    __syncthreads();  // the previous token's k and q are read; S is loaded
    for (int a = threadIdx.x; a < DK; a += blockDim.x) {
      q[a] = row[g * DK + a];
      k[a] = row[KD + g * DK + a];
    }
    __syncthreads();
    if (e < DV) {
      const float dec = decay[t * NV + h], b = beta[t * NV + h];
      float kv = 0.f;  // (Sᵀk)[e] after the decay
      for (int a = 0; a < DK; ++a) {
        const float s = S[a * DV + e] * dec;
        S[a * DV + e] = s;
        kv += s * k[a];
      }
      const float delta = (row[2 * KD + h * DV + e] - kv) * b;
      float o = 0.f;
      for (int a = 0; a < DK; ++a) {
        const float s = S[a * DV + e] + k[a] * delta;
        S[a * DV + e] = s;
        o += s * q[a];
      }
      core[(t * NV + h) * DV + e] = o;
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < DK * DV; i += blockDim.x) next[i] = S[i];
}

// grid ceil(n * num_value_heads / 8), block 256: one warp per (token, value head).
__global__ void GatedNormKernel(float* __restrict__ core, const float* __restrict__ qkvz,
                                const float* __restrict__ w, DeltaNetDims d, float eps,
                                DeltaNetOutputGate gate, int first, int n) {
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
  ConvKernel<<<Blocks(static_cast<int64_t>(n) * dims.conv_channels(), kThreads), kThreads, 0,
               S(stream)>>>(qkvz, conv_weight, dims, chunks, first, n, conv_out);
  return LaunchStatus("DeltaNetConv");
}

absl::Status DeltaNetConvState(const float* qkvz, const DeltaNetDims& dims,
                               const RecurrentChunks& chunks, int first_chunk, int num_chunks,
                               StreamHandle stream) {
  if (num_chunks <= 0 || dims.conv_kernel < 2) return absl::OkStatus();
  ConvStateKernel<<<Blocks(static_cast<int64_t>(num_chunks) * dims.conv_channels(), kThreads),
                    kThreads, 0, S(stream)>>>(qkvz, dims, chunks, first_chunk, num_chunks);
  return LaunchStatus("DeltaNetConvState");
}

absl::Status DeltaNetNormAndGates(float* conv_out, const float* ba, const float* neg_a,
                                  const float* dt_bias, const DeltaNetDims& dims, int first, int n,
                                  float* beta, float* decay, StreamHandle stream) {
  if (n <= 0) return absl::OkStatus();
  NormAndGatesKernel<<<Blocks(static_cast<int64_t>(n) * dims.num_key_heads, kThreads / 32),
                       kThreads, 0, S(stream)>>>(conv_out, ba, neg_a, dt_bias, dims, first, n, beta,
                                                 decay);
  return LaunchStatus("DeltaNetNormAndGates");
}

absl::Status DeltaNetRecurrence(const float* conv_out, const float* beta, const float* decay,
                                const DeltaNetDims& dims, const RecurrentChunks& chunks,
                                int first_chunk, int num_chunks, float* core, StreamHandle stream) {
  if (num_chunks <= 0) return absl::OkStatus();
  RecurrenceKernel<<<static_cast<unsigned>(num_chunks) * dims.num_value_heads,
                     RecurrenceThreads(dims), RecurrenceSharedBytes(dims), S(stream)>>>(
      conv_out, beta, decay, dims, chunks, first_chunk, core);
  return LaunchStatus("DeltaNetRecurrence");
}

absl::Status DeltaNetGatedNorm(float* core, const float* qkvz, const float* norm_weight,
                               const DeltaNetDims& dims, float eps, DeltaNetOutputGate gate, int first, int n,
                               StreamHandle stream) {
  if (n <= 0) return absl::OkStatus();
  GatedNormKernel<<<Blocks(static_cast<int64_t>(n) * dims.num_value_heads, kThreads / 32), kThreads,
                    0, S(stream)>>>(core, qkvz, norm_weight, dims, eps, gate, first, n);
  return LaunchStatus("DeltaNetGatedNorm");
}

absl::Status DeltaNetGroupSeparateProjections(const float* qkv, const float* z, const float* b, const float* a,
                                              const DeltaNetDims& dims, int first, int n, float* qkvz,
                                              float* ba, StreamHandle stream) {
  if (n <= 0) return absl::OkStatus();
  const int64_t items = static_cast<int64_t>(n) * (dims.qkvz_width() + 2 * dims.num_value_heads);
  GroupSeparateKernel<<<Blocks(items, kThreads), kThreads, 0, S(stream)>>>(qkv, z, b, a, dims, first, n, qkvz,
                                                                          ba);
  return LaunchStatus("DeltaNetGroupSeparateProjections");
}

absl::Status PrepareDeltaNetRecurrence(const DeltaNetDims& dims) {
  if (dims.num_key_heads <= 0 || dims.num_value_heads % dims.num_key_heads != 0)
    return absl::InvalidArgumentError(absl::StrCat("DeltaNet: ", dims.num_value_heads,
                                                   " value heads over ", dims.num_key_heads,
                                                   " key heads"));
  if (RecurrenceThreads(dims) > 1024)
    return absl::UnimplementedError(absl::StrCat("DeltaNet: value_head_dim ", dims.value_head_dim,
                                                 " above the recurrence kernel's 1024 threads"));
  int dev = 0, optin = 0;
  EXL3_CUDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
  EXL3_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  const size_t bytes = RecurrenceSharedBytes(dims);
  if (bytes > static_cast<size_t>(optin))
    return absl::UnimplementedError(absl::StrCat(
        "DeltaNet: one head's state [", dims.key_head_dim, ", ", dims.value_head_dim, "] takes ",
        bytes, " bytes of shared memory; this GPU gives a block at most ", optin));
  EXL3_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      RecurrenceKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  return absl::OkStatus();
}

}  // namespace exl3::engine::cuda
