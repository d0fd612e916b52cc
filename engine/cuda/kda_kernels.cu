#include "engine/cuda/kda_kernels.h"

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

// As engine/cpu/linear_attention/kimi_delta_attention.cc computes them (fp32, the same formulas).
__device__ __forceinline__ float Sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float Softplus(float x) { return x > 20.f ? x : logf(1.f + expf(x)); }

__device__ __forceinline__ double WarpSum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Input i of chunk `c`'s conv window for channel `ch`: the conv state's input i for i < K - 1,
// else the chunk's token i - (K - 1) of q, k or v (the channel's third).
__device__ __forceinline__ float WindowInput(const float* q, const float* k, const float* v,
                                             const KdaDims& d, const float* prev_conv,
                                             const RecurrentChunk& c, int i, int ch) {
  const int K = d.conv_kernel, W = d.width();
  if (i < K - 1) return prev_conv[static_cast<size_t>(i) * d.conv_channels() + ch];
  const float* proj = ch < W ? q : ch < 2 * W ? k : v;
  return proj[static_cast<size_t>(c.first + i - (K - 1)) * W + ch % W];
}

// grid ceil(n * C / kThreads), block kThreads: one thread per (token, channel) of rows
// [first, first + n); the conv state read from each token's chunk's read_row.
__global__ void ConvKernel(const float* __restrict__ q, const float* __restrict__ k,
                           const float* __restrict__ v, const float* __restrict__ conv_weight,
                           KdaDims d, RecurrentChunks chunks, int first, int n,
                           float* __restrict__ conv_out) {
  exl3::cuda::PdlEnter();
  const int C = d.conv_channels(), K = d.conv_kernel;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (item >= static_cast<int64_t>(n) * C) return;
  const int t = first + static_cast<int>(item / C), ch = static_cast<int>(item % C);
  const RecurrentChunk c = LoadChunk(chunks, chunks.chunk_of[t]);
  const float* prev = StateRow(chunks, c.read_row);
  const int j = t - c.first;
  const float* w = conv_weight + static_cast<size_t>(ch) * K;
  float acc = 0.f;
  for (int i = 0; i < K; ++i) acc += w[i] * WindowInput(q, k, v, d, prev, c, j + i, ch);
  conv_out[static_cast<size_t>(t) * C + ch] = acc * Sigmoid(acc);
}

// The same convolution for runs of kConvRun tokens: grid (ceil(C / kThreads), ceil(n / kConvRun)),
// block kThreads; thread (x, y) takes channel x · kThreads + threadIdx.x of rows [first + y ·
// kConvRun, ...). Each token's input is loaded once (the run's all at once) and kept for the next
// K − 1 tokens (a window of registers), the channel's K weights once, the run's chunk facts once a
// block (shared memory):
// one thread per (token, channel) reloaded all of them per token and spent most of its
// instructions on the 64-bit division of its item and the window's index arithmetic. The taps are
// summed in ConvKernel's order (acc = Σ_i w[i] · u(j + i), i ascending, from 0): the same bits.
// A token among its chunk's first K − 1 reads the chunk's conv state for the taps before it.
constexpr int kConvRun = 32;
template <int K>
__global__ void __launch_bounds__(kThreads)
    ConvRunKernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                  const float* __restrict__ conv_weight, KdaDims d, RecurrentChunks chunks, int first, int n,
                  float* __restrict__ conv_out) {
  exl3::cuda::PdlEnter();
  __shared__ int first_s[kConvRun], read_s[kConvRun];
  const int C = d.conv_channels(), W = d.width();
  const int t0 = first + static_cast<int>(blockIdx.y) * kConvRun;
  const int run = min(kConvRun, first + n - t0);
  if (threadIdx.x < run) {
    const RecurrentChunk c = LoadChunk(chunks, chunks.chunk_of[t0 + threadIdx.x]);
    first_s[threadIdx.x] = c.first;
    read_s[threadIdx.x] = c.read_row;
  }
  __syncthreads();
  const int ch = static_cast<int>(blockIdx.x) * kThreads + threadIdx.x;
  if (ch >= C) return;
  const float* proj = (ch < W ? q : ch < 2 * W ? k : v) + ch % W;  // the channel's input of row 0
  float w[K];
#pragma unroll
  for (int i = 0; i < K; ++i) w[i] = conv_weight[static_cast<size_t>(ch) * K + i];
  // win[i]: the input of row t − (K − 1) + i, for the next token t (rows before 0 are never read:
  // a tap reads a row only where it is of t's chunk).
  float win[K];
#pragma unroll
  for (int i = 0; i + 1 < K; ++i) {
    const int row = t0 - (K - 1) + i;
    win[i] = row >= 0 ? proj[static_cast<size_t>(row) * W] : 0.f;
  }
  // The run's inputs, all loads in flight before the first tap.
  float x[kConvRun];
#pragma unroll
  for (int jt = 0; jt < kConvRun; ++jt) x[jt] = jt < run ? proj[static_cast<size_t>(t0 + jt) * W] : 0.f;
#pragma unroll
  for (int jt = 0; jt < kConvRun; ++jt) {
    if (jt >= run) break;
    const int t = t0 + jt;
    win[K - 1] = x[jt];
    const int j = t - first_s[jt];  // t's index in its chunk
    float acc = 0.f;
    if (j >= K - 1) {
#pragma unroll
      for (int i = 0; i < K; ++i) acc += w[i] * win[i];
    } else {
      const float* prev = StateRow(chunks, read_s[jt]);
#pragma unroll
      for (int i = 0; i < K; ++i) {
        const float u = j + i < K - 1 ? prev[static_cast<size_t>(j + i) * C + ch] : win[i];
        acc += w[i] * u;
      }
    }
    conv_out[static_cast<size_t>(t) * C + ch] = acc * Sigmoid(acc);
#pragma unroll
    for (int i = 0; i + 1 < K; ++i) win[i] = win[i + 1];
  }
}

// grid ceil(num_chunks * C / kThreads), block kThreads: one thread per (chunk, channel). The
// chunk's new conv state [K - 1, C] at its write_row: the K - 1 window inputs before input
// tokens + K - 1; a verify chunk's kept state s (after its first f = first_kept_token + s + 1
// tokens) those before input f + K - 1, at its row.
__global__ void ConvStateKernel(const float* __restrict__ q, const float* __restrict__ k,
                                const float* __restrict__ v, KdaDims d, RecurrentChunks chunks,
                                int first_chunk, int num_chunks) {
  exl3::cuda::PdlEnter();
  const int C = d.conv_channels(), K = d.conv_kernel;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (item >= static_cast<int64_t>(num_chunks) * C) return;
  const int ch = static_cast<int>(item % C);
  const RecurrentChunk c = LoadChunk(chunks, first_chunk + static_cast<int>(item / C));
  const float* prev = StateRow(chunks, c.read_row);
  for (int s = 0; s < c.kept_states; ++s) {
    float* next = StateRow(chunks, c.KeptRow(s));
    const int folded = c.first_kept_token() + s + 1;  // the chunk's tokens in that state
    for (int i = 0; i < K - 1; ++i)
      next[static_cast<size_t>(i) * C + ch] = WindowInput(q, k, v, d, prev, c, folded + i, ch);
  }
}

// x ← x / sqrt(Σx² + 1e-6) over one head of `len` floats, by one warp (engine/cpu/rms_norm.h's
// L2NormalizeInPlace: the sum in double, the factor rounded to float).
__device__ void WarpL2Normalize(float* x, int len, int lane) {
  double ss = 0.0;
  for (int i = lane; i < len; i += 32) ss += static_cast<double>(x[i]) * x[i];
  ss = WarpSum(ss);
  const float inv = static_cast<float>(1.0 / sqrt(ss + 1e-6));
  __syncwarp();
  for (int i = lane; i < len; i += 32) x[i] *= inv;
}

// grid ceil(n * num_heads / 8), block 256: one warp per (token, head): its q and k normalised,
// its D log-decays and its β.
__global__ void NormAndGatesKernel(float* __restrict__ conv_out, float* __restrict__ log_decay,
                                   float* __restrict__ beta, const float* __restrict__ decay_rate,
                                   const float* __restrict__ dt_bias, KdaForgetGate gate, KdaDims d,
                                   int first, int n) {
  exl3::cuda::PdlEnter();
  const int lane = threadIdx.x % 32;
  const int w = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (w >= n * d.num_heads) return;
  const int t = first + w / d.num_heads, h = w % d.num_heads;
  const int D = d.head_dim, W = d.width();
  float* row = conv_out + static_cast<size_t>(t) * d.conv_channels();
  float* qh = row + h * D;
  WarpL2Normalize(qh, D, lane);
  WarpL2Normalize(row + W + h * D, D, lane);
  const float q_scale = 1.f / sqrtf(static_cast<float>(D));
  for (int i = lane; i < D; i += 32) qh[i] *= q_scale;
  const float rate = decay_rate[h];
  float* g = log_decay + static_cast<size_t>(t) * W + h * D;
  for (int i = lane; i < D; i += 32) {
    const float x = g[i] + dt_bias[h * D + i];
    g[i] = gate.form == KdaForgetGate::Form::kLowerBounded ? gate.lower_bound * Sigmoid(rate * x)
                                                           : -rate * Softplus(x);
  }
  if (lane == 0) {
    float* b = beta + static_cast<size_t>(t) * d.num_heads + h;
    *b = Sigmoid(*b);
  }
}

// grid ceil(n * num_heads / 8), block 256: one warp per (token, head).
__global__ void GatedNormKernel(float* __restrict__ core, const float* __restrict__ gate,
                                const float* __restrict__ w, KdaDims d, float eps, int first,
                                int n) {
  exl3::cuda::PdlEnter();
  const int lane = threadIdx.x % 32;
  const int item = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (item >= n * d.num_heads) return;
  const int t = first + item / d.num_heads, h = item % d.num_heads;
  const int D = d.head_dim;
  const size_t at = static_cast<size_t>(t) * d.width() + static_cast<size_t>(h) * D;
  float* o = core + at;
  const float* g = gate + at;
  double ss = 0.0;
  for (int e = lane; e < D; e += 32) ss += static_cast<double>(o[e]) * o[e];
  ss = WarpSum(ss);
  const float inv = static_cast<float>(1.0 / sqrt(ss / D + static_cast<double>(eps)));
  __syncwarp();
  for (int e = lane; e < D; e += 32) o[e] = (w[e] * (o[e] * inv)) * Sigmoid(g[e]);
}

unsigned Blocks(int64_t items, int per_block) {
  return static_cast<unsigned>((items + per_block - 1) / per_block);
}

}  // namespace

absl::Status KdaConv(const float* q, const float* k, const float* v, const float* conv_weight,
                     const KdaDims& dims, const RecurrentChunks& chunks, int first, int n,
                     float* conv_out, StreamHandle stream) {
  if (n <= 0) return absl::OkStatus();
  const dim3 runs(Blocks(dims.conv_channels(), kThreads), Blocks(n, kConvRun));
  switch (dims.conv_kernel) {
    case 2:
      exl3::cuda::LaunchPdl(ConvRunKernel<2>, dim3(runs), dim3(kThreads), S(stream), q, k, v, conv_weight, dims, chunks,
                            first, n, conv_out);
      break;
    case 3:
      exl3::cuda::LaunchPdl(ConvRunKernel<3>, dim3(runs), dim3(kThreads), S(stream), q, k, v, conv_weight, dims, chunks,
                            first, n, conv_out);
      break;
    case 4:  // GLM-5.3-Flash's
      exl3::cuda::LaunchPdl(ConvRunKernel<4>, dim3(runs), dim3(kThreads), S(stream), q, k, v, conv_weight, dims, chunks,
                            first, n, conv_out);
      break;
    default:
      exl3::cuda::LaunchPdl(ConvKernel, dim3(Blocks(static_cast<int64_t>(n) * dims.conv_channels(), kThreads)),
                            dim3(kThreads), S(stream), q, k, v, conv_weight, dims, chunks, first, n, conv_out);
  }
  return LaunchStatus("KdaConv");
}

absl::Status KdaConvState(const float* q, const float* k, const float* v, const KdaDims& dims,
                          const RecurrentChunks& chunks, int first_chunk, int num_chunks,
                          StreamHandle stream) {
  if (num_chunks <= 0 || dims.conv_kernel < 2) return absl::OkStatus();
  exl3::cuda::LaunchPdl(ConvStateKernel,
                        dim3(Blocks(static_cast<int64_t>(num_chunks) * dims.conv_channels(), kThreads)), dim3(kThreads),
                        S(stream), q, k, v, dims, chunks, first_chunk, num_chunks);
  return LaunchStatus("KdaConvState");
}

absl::Status KdaNormAndGates(float* conv_out, float* log_decay, float* beta,
                             const float* decay_rate, const float* dt_bias,
                             const KdaForgetGate& gate, const KdaDims& dims, int first, int n,
                             StreamHandle stream) {
  if (n <= 0) return absl::OkStatus();
  exl3::cuda::LaunchPdl(NormAndGatesKernel, dim3(Blocks(static_cast<int64_t>(n) * dims.num_heads, kThreads / 32)),
                        dim3(kThreads), S(stream), conv_out, log_decay, beta, decay_rate, dt_bias, gate, dims, first,
                        n);
  return LaunchStatus("KdaNormAndGates");
}

namespace {

DeltaRuleShape KdaDeltaRuleShape(const KdaDims& d) {
  DeltaRuleShape sh;
  sh.num_heads = d.num_heads;
  sh.key_head_dim = sh.value_head_dim = d.head_dim;
  sh.row_floats = d.conv_channels();
  sh.q_at = 0;
  sh.k_at = d.width();
  sh.v_at = 2 * d.width();
  sh.state_at = d.conv_state_floats();
  return sh;
}

}  // namespace

absl::Status KdaRecurrence(const float* conv_out, const float* log_decay, const float* beta,
                           const KdaDims& dims, const RecurrentChunks& chunks, int first_chunk,
                           int num_chunks, float* core, StreamHandle stream) {
  return DeltaRuleRecurrence(conv_out, beta, log_decay, DeltaRuleDecay::kPerKeyChannelLog,
                             KdaDeltaRuleShape(dims), chunks, first_chunk, num_chunks, core, stream);
}

absl::Status KdaGatedNorm(float* core, const float* gate, const float* o_norm, const KdaDims& dims,
                          float eps, int first, int n, StreamHandle stream) {
  if (n <= 0) return absl::OkStatus();
  exl3::cuda::LaunchPdl(GatedNormKernel, dim3(Blocks(static_cast<int64_t>(n) * dims.num_heads, kThreads / 32)),
                        dim3(kThreads), S(stream), core, gate, o_norm, dims, eps, first, n);
  return LaunchStatus("KdaGatedNorm");
}

absl::Status CheckKdaDims(const KdaDims& dims) {
  if (dims.num_heads <= 0 || dims.head_dim <= 0 || dims.conv_kernel < 1)
    return absl::InvalidArgumentError(absl::StrCat("KDA: ", dims.num_heads, " heads of ",
                                                   dims.head_dim, ", conv kernel ",
                                                   dims.conv_kernel));
  return CheckDeltaRuleShape(KdaDeltaRuleShape(dims));
}

}  // namespace exl3::engine::cuda
