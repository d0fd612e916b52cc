#include "engine/cuda/hyper_connection_kernels.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cuda/block_reduce.cuh"
#include "engine/cuda/launch_status.cuh"
#include "kernels/cuda/launch.cuh"

namespace exl3::engine::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxStreams = 16;

__device__ inline float SigmoidF(float x) { return 1.0f / (1.0f + expf(-x)); }

// mix[r] = fn[r] · (x / rms(x)) for r < rows, x [width] (NormedMixes of engine/cpu/residual/hyper_connections.cc).
__device__ void NormedMixes(const float* x, int width, float norm_eps, const float* fn, int rows,
                            float* mix /*shared*/, double* partial) {
  double ss = 0.0;
  for (int i = threadIdx.x; i < width; i += blockDim.x) ss += static_cast<double>(x[i]) * x[i];
  ss = BlockSumDouble(ss, partial);
  const float inv = static_cast<float>(1.0 / sqrt(ss / width + norm_eps));
  for (int r = 0; r < rows; ++r) {
    const float* w = fn + static_cast<size_t>(r) * width;
    double acc = 0.0;
    for (int i = threadIdx.x; i < width; i += blockDim.x) acc += static_cast<double>(w[i]) * (x[i] * inv);
    acc = BlockSumDouble(acc, partial);
    if (threadIdx.x == 0) mix[r] = static_cast<float>(acc);
  }
  __syncthreads();
}

// The expand at hidden position d of one token's streams x [N, H], in place:
// x_k[d] ← post[k] · od + Σ_j comb[j][k] · x_j[d] (HyperConnection::Expand's order); keep(k, value)
// sees every new value. post [N], comb [N, N] (shared memory).
template <typename Keep>
__device__ __forceinline__ void ExpandAt(float* x, int H, int d, int n, const float* post, const float* comb,
                                         float od, Keep keep) {
  float in[kMaxStreams];
#pragma unroll
  for (int j = 0; j < kMaxStreams; ++j) {
    if (j < n) in[j] = x[static_cast<size_t>(j) * H + d];
  }
#pragma unroll
  for (int k = 0; k < kMaxStreams; ++k) {
    if (k < n) {
      float acc = 0.0f;
#pragma unroll
      for (int j = 0; j < kMaxStreams; ++j) {
        if (j < n) acc += comb[j * n + k] * in[j];
      }
      const float v = post[k] * od + acc;
      x[static_cast<size_t>(k) * H + d] = v;
      keep(k, v);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The collapse: MixSumsKernel's partial sums, CollapseFinishKernel's totals.

constexpr int kWarpsPerBlock = kThreads / 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kMaxMixes = (2 + kMaxStreams) * kMaxStreams;  // fn's rows at N = 16
constexpr int kPairSlots = 2048;        // products a MixSumsKernel pass keeps in shared memory (8 a thread)
constexpr int kMaxSlice = 256;          // hidden positions of one MixSumsKernel block
constexpr int kSliceTargetBlocks = 128; // MixSumsKernel blocks a launch aims at (about one a multiprocessor)
constexpr int kFinishSpan = 512;        // hidden positions of one CollapseFinishKernel block
constexpr int kMaxFinishBlocks = 16;

// Rows of a token's partial sums: fn's (2 + N) N mix rows, then the N (N + 1) / 2 products of
// stream pairs i ≤ j (GramIndex).
__host__ __device__ inline int MixRows(int n) { return (2 + n) * n; }
__host__ __device__ inline int SumRows(int n) { return MixRows(n) + n * (n + 1) / 2; }
// Position of the pair i ≤ j among the pairs in row-major order of the upper triangle.
__device__ inline int GramIndex(int i, int j, int n) { return i * n - i * (i - 1) / 2 + (j - i); }

__device__ inline double WarpSumDouble(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

__device__ __forceinline__ float4 LoadUnit(const float4* p) { return __ldg(p); }
__device__ __forceinline__ float LoadUnit(const float* p) { return __ldg(p); }
__device__ __forceinline__ double DotDouble(float4 w, float4 x) {
  return static_cast<double>(w.x) * x.x + static_cast<double>(w.y) * x.y + static_cast<double>(w.z) * x.z +
         static_cast<double>(w.w) * x.w;
}
__device__ __forceinline__ double DotDouble(float w, float x) { return static_cast<double>(w) * x; }

// grid (T, splits), block kThreads. Block (t, s) takes hidden positions [s · slice, s · slice + len)
// of token t's N streams (len = slice but at the end).
//   streams [T, N, H] fp32; fn [(2 + N) N, N H] fp32;
//   ex (where ex.post is set): post [T, N], comb [T, N, N], block_output [T, H] fp32 — the slice's
//     streams become post[k] · o + Σ_j comb[j][k] · stream_j first (ExpandKernel's arithmetic), in place;
//   partial [T, SumRows(N), splits] fp64: the slice's Σ fn[r] · x for mix row r (x the token's N H
//     inputs, unnormalised), then its Σ_d stream_i[d] · stream_j[d] for each pair i ≤ j.
// The slice's inputs are staged in shared memory; each pass over mix rows issues all its fn loads
// (float4s where kVector: H % 4 == 0 and fn 16-byte aligned) before the first product, keeps the
// products and sums each row's in a fixed order on one warp.
template <bool kVector>
__global__ void __launch_bounds__(kThreads)
    MixSumsKernel(const float* __restrict__ fn, int n, int H, int slice, HyperExpandInput ex, float* streams,
                  double* partial) {
  exl3::cuda::PdlEnter();
  using Unit = typename std::conditional<kVector, float4, float>::type;
  constexpr int V = kVector ? 4 : 1;
  constexpr int kPer = kPairSlots / kThreads;
  __shared__ __align__(16) float xs[kPairSlots];  // [N][slice]
  __shared__ double products[kPairSlots];
  __shared__ float mixw[kMaxStreams + kMaxStreams * kMaxStreams];  // the expand's post, comb
  const size_t t = blockIdx.x;
  const int s = blockIdx.y, splits = gridDim.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int width = n * H, mixes = MixRows(n);
  const int d0 = s * slice, len = min(slice, H - d0);
  float* x = streams + t * width;
  double* out = partial + t * SumRows(n) * splits + s;  // row r at out[r · splits]
  if (ex.post != nullptr) {
    for (int i = threadIdx.x; i < n + n * n; i += kThreads)
      mixw[i] = i < n ? ex.post[t * n + i] : ex.comb[t * n * n + (i - n)];
    __syncthreads();
    const float* post = mixw;
    const float* comb = mixw + n;
    const float* o = ex.block_output + t * H;
    for (int dd = threadIdx.x; dd < len; dd += kThreads)
      ExpandAt(x, H, d0 + dd, n, post, comb, o[d0 + dd], [&](int k, float v) { xs[k * slice + dd] = v; });
  } else {
    for (int e = threadIdx.x; e < n * len; e += kThreads) {
      const int i = e / len, dd = e - i * len;
      xs[i * slice + dd] = x[static_cast<size_t>(i) * H + d0 + dd];
    }
  }
  __syncthreads();
  // The stream pairs' sums (shared memory only).
  const int pairs_ij = n * (n + 1) / 2;
  for (int g = warp; g < pairs_ij; g += kWarpsPerBlock) {
    int a = 0, rest = g;
    while (rest >= n - a) rest -= n - a++;
    const int b = a + rest;
    double v = 0.0;
    for (int dd = lane; dd < len; dd += 32) v += static_cast<double>(xs[a * slice + dd]) * xs[b * slice + dd];
    v = WarpSumDouble(v);
    if (lane == 0) out[static_cast<size_t>(mixes + g) * splits] = v;
  }
  // Pair p of a pass: (row r0 + p / units, unit p % units of the row: stream i, unit q of its slice).
  // A thread's pairs are p = threadIdx.x + m · kThreads: its first found by division, each next one
  // kThreads units on (step_r rows, then step_i streams and step_q units, with carries).
  const int q_per = len / V;    // units of one stream in the slice
  const int units = n * q_per;  // of one mix row
  const int rows_per_pass = max(1, kPairSlots / units);
  const int r_first = threadIdx.x / units, c_first = threadIdx.x % units;
  const int i_first = c_first / q_per, q_first = c_first % q_per;
  const int step_r = kThreads / units, step_c = kThreads % units;
  const int step_i = step_c / q_per, step_q = step_c % q_per;
  for (int r0 = 0; r0 < mixes; r0 += rows_per_pass) {
    const int pass_rows = min(rows_per_pass, mixes - r0), pairs = pass_rows * units;
    Unit w[kPer];
    int xo[kPer];  // the pair's offset in xs
    int r = r0 + r_first, i = i_first, q = q_first;
#pragma unroll
    for (int m = 0; m < kPer; ++m) {
      if (threadIdx.x + m * kThreads < pairs) {
        w[m] = LoadUnit(reinterpret_cast<const Unit*>(fn + static_cast<size_t>(r) * width + i * H + d0) + q);
        xo[m] = i * slice + q * V;
      }
      r += step_r;
      i += step_i;
      q += step_q;
      if (q >= q_per) {
        q -= q_per;
        ++i;
      }
      if (i >= n) {
        i -= n;
        ++r;
      }
    }
#pragma unroll
    for (int m = 0; m < kPer; ++m) {
      const int p = threadIdx.x + m * kThreads;
      if (p < pairs) products[p] = DotDouble(w[m], *reinterpret_cast<const Unit*>(xs + xo[m]));
    }
    __syncthreads();
    for (int rr = warp; rr < pass_rows; rr += kWarpsPerBlock) {
      double v = 0.0;
      for (int c = lane; c < units; c += 32) v += products[rr * units + c];
      v = WarpSumDouble(v);
      if (lane == 0) out[static_cast<size_t>(r0 + rr) * splits] = v;
    }
    __syncthreads();  // products are the next pass's
  }
}

// ---------------------------------------------------------------------------------------------
// The collapse's sums at prefill: many tokens a block.
//
// MixSumsKernel takes one token a block, so each of a prefill's T tokens reads every fn row of its
// slice from L2 again (fn is (2 + N) N × N H fp32: 1.5 MB at N = 4, H = 4096, so 1.6 GB a collapse at
// T = 1024) and converts every fn element to double for a single product. MixSumsTiledKernel
// stages kTileTokens tokens' inputs and the slice's fn rows in shared memory as doubles, each
// converted once, and forms the products as a small GEMM: thread (ty, tx) keeps the sums of tokens
// ty and ty + 32 against mix rows tx, tx + 8 and tx + 16 in registers over the block's whole slice
// (kChunk hidden positions a pass), two fn and two input doubles a 16-byte shared load, so the
// double FMAs, not L2 or shared memory, bound it. The stream pairs' sums come from the same
// registers the inputs are staged from. Every product is exact in double and each sum runs in a
// fixed order (another order than MixSumsKernel's, so a token's mixes may differ from that kernel's
// in their last double bits: the same to far below the float they are rounded to, the same bits
// run to run). For N ≤ kTiledMaxStreams, H a multiple of 4 and 16-byte aligned arrays.
constexpr int kTileTokens = 64;                                  // tokens a block
constexpr int kChunk = 16;                                       // hidden positions a pass
constexpr int kTiledMaxStreams = 4;                              // N (the released models': 4)
constexpr int kTiledMaxK = kTiledMaxStreams * kChunk;            // a pass's inputs of one token
constexpr int kTiledStride = kTiledMaxK + 2;                     // doubles a staged row (16 bytes of bank offset)
constexpr int kTiledMaxMixes = (2 + kTiledMaxStreams) * kTiledMaxStreams;
constexpr int kTiledMaxPairs = kTiledMaxStreams * (kTiledMaxStreams + 1) / 2;
constexpr int kTiledMinTokens = 16;      // fewer: MixSumsKernel (the decode step's, unchanged)
constexpr int kTiledTargetBlocks = 512;  // about 4 a multiprocessor
constexpr int kTiledMaxChunks = 16;      // passes a block (hidden positions: kChunk times)
constexpr size_t kTiledSmemBytes =
    static_cast<size_t>(kTileTokens + kTiledMaxMixes) * kTiledStride * sizeof(double) +
    static_cast<size_t>(kTileTokens) * (kTiledMaxStreams + kTiledMaxStreams * kTiledMaxStreams) * sizeof(float);
static_assert(kThreads == 4 * kTileTokens, "a staging thread per (token, 4 hidden positions of a pass)");
static_assert(kThreads == 8 * (kTileTokens / 2), "a summing thread per (2 tokens, 3 mix rows)");
static_assert(kTiledMaxMixes == 3 * 8, "8 threads of a token pair cover the mix rows, 3 each");

// grid (ceil(T / kTileTokens), splits), block kThreads, kTiledSmemBytes of dynamic shared memory.
// Block (b, s) takes tokens [b · kTileTokens, ...) at hidden positions [s · chunks · kChunk, ...)
// (chunks passes). Arguments and partial as MixSumsKernel's (kExpand: ex.post set).
template <bool kExpand>
__global__ void __launch_bounds__(kThreads, kExpand ? 2 : 3)
    MixSumsTiledKernel(const float* __restrict__ fn, int n, int H, int T, int chunks, HyperExpandInput ex,
                       float* streams, double* partial) {
  exl3::cuda::PdlEnter();
  extern __shared__ __align__(16) double tiled_smem[];
  double* xs = tiled_smem;                        // [kTileTokens][kTiledStride]: token, i · kChunk + dd
  double* ws = xs + kTileTokens * kTiledStride;   // [kTiledMaxMixes][kTiledStride]: fn row, i · kChunk + dd
  float* pc = reinterpret_cast<float*>(ws + kTiledMaxMixes * kTiledStride);  // [kTileTokens][N + N²]
  const int tid = threadIdx.x;
  const int t0 = blockIdx.x * kTileTokens, s = blockIdx.y, splits = gridDim.y;
  const int width = n * H, mixes = MixRows(n), K = n * kChunk, npc = n + n * n;
  const size_t out_stride = static_cast<size_t>(SumRows(n)) * splits;  // a token's partial sums
  // Staging: token lt, hidden positions 4 lq .. 4 lq + 3 of each pass.
  const int lt = tid / 4, lq = tid % 4;
  const int st = t0 + lt;
  const bool st_live = st < T;
  float* x_tok = streams + static_cast<size_t>(st) * width;
  if constexpr (kExpand) {
    for (int i = tid; i < kTileTokens * npc; i += kThreads) {
      const int tt = i / npc, e = i - tt * npc;
      const size_t t = static_cast<size_t>(t0 + tt);
      pc[i] = t0 + tt < T ? (e < n ? ex.post[t * n + e] : ex.comb[t * n * n + (e - n)]) : 0.0f;
    }
    __syncthreads();
  }
  // Summing: tokens ty, ty + 32 against mix rows tx + 8 j.
  const int ty = tid / 8, tx = tid % 8;
  bool row_live[3];
#pragma unroll
  for (int j = 0; j < 3; ++j) row_live[j] = tx + 8 * j < mixes;
  double acc[2][3] = {};
  double pair[kTiledMaxPairs] = {};
  const int d_first = s * chunks * kChunk;
  for (int c = 0; c < chunks; ++c) {
    const int d0 = d_first + c * kChunk;
    if (d0 >= H) break;  // the same for the whole block
    {
      const int d = d0 + 4 * lq;
      const bool in = st_live && d < H;
      float4 v[kTiledMaxStreams];
#pragma unroll
      for (int i = 0; i < kTiledMaxStreams; ++i) {
        v[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (i < n && in) v[i] = *reinterpret_cast<const float4*>(x_tok + static_cast<size_t>(i) * H + d);
      }
      if constexpr (kExpand) {
        // ExpandAt's arithmetic per element: x_k ← post[k] · o + Σ_j comb[j][k] · x_j, in place.
        if (in) {
          const float4 o = *reinterpret_cast<const float4*>(ex.block_output + static_cast<size_t>(st) * H + d);
          const float* post = pc + lt * npc;
          const float* comb = post + n;
          float4 e[kTiledMaxStreams];
#pragma unroll
          for (int k = 0; k < kTiledMaxStreams; ++k) {
            if (k < n) {
              float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
              for (int j = 0; j < kTiledMaxStreams; ++j) {
                if (j < n) {
                  const float cjk = comb[j * n + k];
                  a.x += cjk * v[j].x;
                  a.y += cjk * v[j].y;
                  a.z += cjk * v[j].z;
                  a.w += cjk * v[j].w;
                }
              }
              const float pk = post[k];
              e[k] = make_float4(pk * o.x + a.x, pk * o.y + a.y, pk * o.z + a.z, pk * o.w + a.w);
              *reinterpret_cast<float4*>(x_tok + static_cast<size_t>(k) * H + d) = e[k];
            }
          }
#pragma unroll
          for (int k = 0; k < kTiledMaxStreams; ++k) {
            if (k < n) v[k] = e[k];
          }
        }
      }
      // The pairs' products (the four positions in order; pair a ≤ b kept at GramIndex(a, b,
      // kTiledMaxStreams), a register), then the inputs staged as doubles.
#pragma unroll
      for (int a = 0; a < kTiledMaxStreams; ++a) {
#pragma unroll
        for (int b = a; b < kTiledMaxStreams; ++b) {
          if (b < n) pair[GramIndex(a, b, kTiledMaxStreams)] += DotDouble(v[a], v[b]);
        }
      }
      double* row = xs + lt * kTiledStride + 4 * lq;
#pragma unroll
      for (int i = 0; i < kTiledMaxStreams; ++i) {
        if (i < n) {
          reinterpret_cast<double2*>(row + i * kChunk)[0] = make_double2(v[i].x, v[i].y);
          reinterpret_cast<double2*>(row + i * kChunk)[1] = make_double2(v[i].z, v[i].w);
        }
      }
    }
    for (int item = tid; item < mixes * n * 4; item += kThreads) {
      const int r = item / (4 * n), rest = item - r * 4 * n, i = rest / 4, q = rest % 4;
      const int d = d0 + 4 * q;
      float4 w = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (d < H) w = __ldg(reinterpret_cast<const float4*>(fn + static_cast<size_t>(r) * width + static_cast<size_t>(i) * H + d));
      double* wr = ws + r * kTiledStride + i * kChunk + 4 * q;
      reinterpret_cast<double2*>(wr)[0] = make_double2(w.x, w.y);
      reinterpret_cast<double2*>(wr)[1] = make_double2(w.z, w.w);
    }
    __syncthreads();
    const double2* x0 = reinterpret_cast<const double2*>(xs + ty * kTiledStride);
    const double2* x1 = reinterpret_cast<const double2*>(xs + (ty + kTileTokens / 2) * kTiledStride);
    const double2* w0 = reinterpret_cast<const double2*>(ws + tx * kTiledStride);
    const double2* w1 = reinterpret_cast<const double2*>(ws + (tx + 8) * kTiledStride);
    const double2* w2 = reinterpret_cast<const double2*>(ws + (tx + 16) * kTiledStride);
#pragma unroll 4
    for (int k2 = 0; k2 < K / 2; ++k2) {
      const double2 a0 = x0[k2], a1 = x1[k2];
      const double2* wj[3] = {w0, w1, w2};
#pragma unroll
      for (int j = 0; j < 3; ++j) {
        if (row_live[j]) {
          const double2 w = wj[j][k2];
          acc[0][j] = fma(a0.x, w.x, acc[0][j]);
          acc[0][j] = fma(a0.y, w.y, acc[0][j]);
          acc[1][j] = fma(a1.x, w.x, acc[1][j]);
          acc[1][j] = fma(a1.y, w.y, acc[1][j]);
        }
      }
    }
    __syncthreads();  // the staged rows are the next pass's
  }
  // A token's four staging lanes (lanes 4m .. 4m + 3 of a warp) add their pair sums: (0 + 1) + (2 + 3).
#pragma unroll
  for (int g = 0; g < kTiledMaxPairs; ++g) {
    pair[g] += __shfl_xor_sync(kFullMask, pair[g], 1);
    pair[g] += __shfl_xor_sync(kFullMask, pair[g], 2);
  }
  if (lq == 0 && st_live) {
    double* out = partial + static_cast<size_t>(st) * out_stride + s;
#pragma unroll
    for (int a = 0; a < kTiledMaxStreams; ++a) {
#pragma unroll
      for (int b = a; b < kTiledMaxStreams; ++b) {
        if (b < n)
          out[static_cast<size_t>(mixes + GramIndex(a, b, n)) * splits] = pair[GramIndex(a, b, kTiledMaxStreams)];
      }
    }
  }
#pragma unroll
  for (int a = 0; a < 2; ++a) {
    const int t = t0 + ty + a * (kTileTokens / 2);
    if (t >= T) continue;
    double* out = partial + static_cast<size_t>(t) * out_stride + s;
#pragma unroll
    for (int j = 0; j < 3; ++j) {
      if (row_live[j]) out[static_cast<size_t>(tx + 8 * j) * splits] = acc[a][j];
    }
  }
}

// Σ_q __shfl(v, first + q · stride) over q < n ≤ kLaneStreams in the order of q: every shuffle
// issued before the first addition, so a row's or column's sum waits for one shuffle's latency and
// then the n additions (the same additions as a loop of shuffle-then-add: the same bits). All
// kLaneStreams shuffles run, without a branch between them; those at q ≥ n (their lane index
// taken mod 32) are not added.
constexpr int kLaneStreams = 5;  // the most streams whose N² elements fit a warp's lanes
__device__ __forceinline__ float LaneSum(float v, int first, int stride, int n) {
  float g[kLaneStreams];
#pragma unroll
  for (int q = 0; q < kLaneStreams; ++q) g[q] = __shfl_sync(kFullMask, v, first + q * stride);
  float s = 0.0f;
#pragma unroll
  for (int q = 0; q < kLaneStreams; ++q) {
    if (q < n) s += g[q];
  }
  return s;
}

// comb [N, N] of one token from its logit mixes lm [N, N] (fn · x / rms, comb's rows), base [N, N]
// and scale: a softmax per row plus eps, then Sinkhorn (columns once, then rows and columns
// iters − 1 times, each sum + eps), every sum in the CPU's order (HyperConnection::Collapse). Warp
// 0 of the block, lane e holding element e (N² ≤ 32), sums gathered by shuffles (LaneSum). Each
// lane divides its own element by its row's (column's) sum, exactly as the CPU does: a reciprocal
// per sum would not save a lane any operation.
__device__ void SinkhornLanes(const float* lm, const float* base, float scale, float eps, int n, int iters,
                              float* comb) {
  const int lane = threadIdx.x % 32;
  const bool on = lane < n * n;
  const int j = on ? lane / n : 0, k = on ? lane % n : 0;
  const float logit = on ? lm[lane] * scale + base[lane] : 0.0f;
  float row_logits[kLaneStreams];
#pragma unroll
  for (int q = 0; q < kLaneStreams; ++q) row_logits[q] = __shfl_sync(kFullMask, logit, j * n + q);
  float mx = -INFINITY;
#pragma unroll
  for (int q = 0; q < kLaneStreams; ++q) {
    if (q < n) mx = fmaxf(mx, row_logits[q]);
  }
  const float ex = on ? expf(logit - mx) : 0.0f;
  float c = on ? ex / LaneSum(ex, j * n, 1, n) + eps : 0.0f;
  auto columns = [&] { c /= LaneSum(c, k, n, n) + eps; };
  auto rows = [&] { c /= LaneSum(c, j * n, 1, n) + eps; };
  columns();
  for (int it = 0; it + 1 < iters; ++it) {
    rows();
    columns();
  }
  if (on) comb[lane] = c;
}

// The same for N² > 32: warp 0, lane l holding elements l + 32 m, the matrix exchanged through
// cm [N²] in shared memory.
__device__ void SinkhornShared(const float* lm, const float* base, float scale, float eps, int n, int iters,
                               float* cm, float* comb) {
  constexpr int kPer = kMaxStreams * kMaxStreams / 32;
  const int lane = threadIdx.x % 32, nn = n * n;
  float c[kPer];
  int row[kPer], col[kPer];
#pragma unroll
  for (int m = 0; m < kPer; ++m) {
    const int e = lane + 32 * m;
    row[m] = e / n;
    col[m] = e % n;
    if (e < nn) cm[e] = lm[e] * scale + base[e];
  }
  __syncwarp();
#pragma unroll
  for (int m = 0; m < kPer; ++m) {
    const int e = lane + 32 * m;
    if (e < nn) {
      const int j = row[m];
      float mx = -INFINITY;
      for (int q = 0; q < n; ++q) mx = fmaxf(mx, cm[j * n + q]);
      c[m] = expf(cm[e] - mx);
    }
  }
  // Sums of each element's row (or column) of the matrix c holds, in order; c[m] = c[m] / sum + add
  // (softmax) or c[m] / (sum + eps) (Sinkhorn).
  auto normalise = [&](bool columns, bool softmax) {
    __syncwarp();
#pragma unroll
    for (int m = 0; m < kPer; ++m) {
      const int e = lane + 32 * m;
      if (e < nn) cm[e] = c[m];
    }
    __syncwarp();
#pragma unroll
    for (int m = 0; m < kPer; ++m) {
      const int e = lane + 32 * m;
      if (e < nn) {
        const int j = row[m], k = col[m];
        float s = 0.0f;
        for (int q = 0; q < n; ++q) s += columns ? cm[q * n + k] : cm[j * n + q];
        c[m] = softmax ? c[m] / s + eps : c[m] / (s + eps);
      }
    }
  };
  normalise(false, true);
  normalise(true, false);
  for (int it = 0; it + 1 < iters; ++it) {
    normalise(false, false);
    normalise(true, false);
  }
#pragma unroll
  for (int m = 0; m < kPer; ++m) {
    const int e = lane + 32 * m;
    if (e < nn) comb[e] = c[m];
  }
}

// sums[k] = the total over the splits of token row row_of(k) of p [SumRows(N), splits] (one token's
// partial sums), k < count: a warp a row (rows warp, warp + kWarpsPerBlock, ...), each lane adding
// its splits in order, then the warp's shuffle tree, so every block that totals a row forms the
// same value. A warp loads kRowGroup of its rows together: all their loads in flight before the
// first addition.
constexpr int kRowGroup = 4;
template <typename RowOf>
__device__ __forceinline__ void TotalRows(const double* p, int splits, int count, RowOf row_of, double* sums) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int k0 = warp; k0 < count; k0 += kWarpsPerBlock * kRowGroup) {
    const double* rp[kRowGroup];
    double v[kRowGroup];
#pragma unroll
    for (int g = 0; g < kRowGroup; ++g) {
      const int k = k0 + g * kWarpsPerBlock;
      rp[g] = k < count ? p + static_cast<size_t>(row_of(k)) * splits : nullptr;
      v[g] = 0.0;
    }
    for (int s = lane; s < splits; s += 32) {
#pragma unroll
      for (int g = 0; g < kRowGroup; ++g) {
        if (rp[g] != nullptr) v[g] += rp[g][s];
      }
    }
#pragma unroll
    for (int g = 0; g < kRowGroup; ++g) {
      const int k = k0 + g * kWarpsPerBlock;
      const double total = WarpSumDouble(v[g]);
      if (k < count && lane == 0) sums[k] = total;
    }
  }
}

// One warp's shared memory for MixWarp.
struct MixWarpScratch {
  double sums[kMaxMixes + kMaxStreams];
  float mix[kMaxMixes];
  float cm[kMaxStreams * kMaxStreams];
};

// Token t's post and comb from its partial sums p [SumRows(N), splits] (MixSumsKernel's), on one
// warp (the block's other warps free for other tokens): the totals of fn's mix rows and of the pairs
// (i, i), each as TotalRows forms it (lane l adds splits l, l + 32, ... in order, then the warp's
// shuffle tree: the same bits), kMixRowGroup rows' loads in flight at once; rms = sqrt(Σ_i x_i ·
// x_i / (N H) + norm_eps), mix[r] = total_r / rms; out.post [T, N] = 2 sigmoid(mix[N + k] ·
// scale[1] + base[N + k]), out.comb [T, N, N] from mix[2N ...] (SinkhornLanes / SinkhornShared).
constexpr int kMixRowGroup = 8;
__device__ void MixWarp(const HyperConnectionArgs& a, const double* p, int splits, const HyperCollapseOutput& out,
                        size_t t, MixWarpScratch& w) {
  const int lane = threadIdx.x % 32;
  const int n = a.streams, width = n * a.hidden, mixes = MixRows(n), count = mixes + n;
  for (int k0 = 0; k0 < count; k0 += kMixRowGroup) {
    const double* rp[kMixRowGroup];
    double v[kMixRowGroup];
#pragma unroll
    for (int g = 0; g < kMixRowGroup; ++g) {
      const int k = k0 + g;
      const int row = k < mixes ? k : mixes + GramIndex(k - mixes, k - mixes, n);
      rp[g] = k < count ? p + static_cast<size_t>(row) * splits : nullptr;
      v[g] = 0.0;
    }
    for (int s = lane; s < splits; s += 32) {
#pragma unroll
      for (int g = 0; g < kMixRowGroup; ++g) {
        if (rp[g] != nullptr) v[g] += rp[g][s];
      }
    }
#pragma unroll
    for (int g = 0; g < kMixRowGroup; ++g) {
      const double total = WarpSumDouble(v[g]);
      if (k0 + g < count && lane == 0) w.sums[k0 + g] = total;
    }
  }
  __syncwarp();
  double ss = 0.0;
  for (int i = 0; i < n; ++i) ss += w.sums[mixes + i];
  const double inv_rms = 1.0 / sqrt(ss / width + a.norm_eps);
  for (int r = lane; r < mixes; r += 32) w.mix[r] = static_cast<float>(w.sums[r] * inv_rms);
  __syncwarp();
  if (lane < n) out.post[t * n + lane] = 2.0f * SigmoidF(w.mix[n + lane] * a.scale[1] + a.base[n + lane]);
  float* comb = out.comb + t * n * n;
  if (n * n <= 32) {
    SinkhornLanes(w.mix + 2 * n, a.base + 2 * n, a.scale[2], a.eps, n, a.sinkhorn_iters, comb);
  } else {
    SinkhornShared(w.mix + 2 * n, a.base + 2 * n, a.scale[2], a.eps, n, a.sinkhorn_iters, w.cm, comb);
  }
}

// The block input's weights pre [n] and, with a normed output, its norm's scale *inv_out (both
// shared) from the totals of p's rows (InputBlock below). Every thread of the block calls it.
__device__ void InputBlockScales(const HyperConnectionArgs& a, const double* p, int splits,
                                 const HyperCollapseOutput& out, float* pre, float* inv_out) {
  __shared__ double sums[kMaxStreams + kMaxStreams * (kMaxStreams + 1) / 2];
  const int n = a.streams, H = a.hidden, width = n * H, mixes = MixRows(n);
  TotalRows(p, splits, n + n * (n + 1) / 2, [&](int k) { return k < n ? k : mixes + (k - n); }, sums);
  __syncthreads();
  double ss = 0.0;
  for (int i = 0; i < n; ++i) ss += sums[n + GramIndex(i, i, n)];
  const double inv_rms = 1.0 / sqrt(ss / width + a.norm_eps);
  if (threadIdx.x < n)
    pre[threadIdx.x] =
        SigmoidF(static_cast<float>(sums[threadIdx.x] * inv_rms) * a.scale[0] + a.base[threadIdx.x]) + a.eps;
  __syncthreads();
  if (out.normed != nullptr && threadIdx.x == 0) {
    double yy = 0.0;
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j)
        yy += static_cast<double>(pre[i]) * pre[j] * sums[n + GramIndex(min(i, j), max(i, j), n)];
    }
    *inv_out = static_cast<float>(1.0 / sqrt(yy / H + out.norm_eps));
  }
  __syncthreads();
}

// Token t's block input and its norm at hidden positions [lo, hi) from its partial sums p
// [SumRows(N), splits] and streams x [N, H]: the totals of pre's rows and of every pair (the same
// values in every such block), rms as MixWarp's from the pairs' diagonal, mix[r] = total_r / rms;
//   out.block_input [T, H] = Σ_i pre[i] · stream_i, pre[i] = sigmoid(mix[i] · scale[0] + base[i]) + eps;
//   out.normed [T, H] = norm_weight [H] · (block_input · inv), inv = 1 / sqrt(mean(block_input²) +
//     norm_eps), mean(block_input²) = Σ_ij pre_i pre_j (x_i · x_j) / H from the pair totals, so no
//     block waits for another's part of the hidden vector.
__device__ void InputBlock(const HyperConnectionArgs& a, const double* p, int splits, const float* x, int lo, int hi,
                           const HyperCollapseOutput& out, size_t t) {
  __shared__ float pre[kMaxStreams];
  __shared__ float inv_out;
  const int n = a.streams, H = a.hidden;
  InputBlockScales(a, p, splits, out, pre, &inv_out);
  for (int d = lo + threadIdx.x; d < hi; d += kThreads) {
    float acc = 0.0f;
    for (int i = 0; i < n; ++i) acc += pre[i] * x[static_cast<size_t>(i) * H + d];
    out.block_input[t * H + d] = acc;
    if (out.normed != nullptr) out.normed[t * H + d] = out.norm_weight[d] * (acc * inv_out);
  }
}

// InputBlock's arithmetic four positions a thread: [lo, hi) at most 4 kThreads positions, each
// thread's streams (and norm weights) loaded before the totals, so the two loads' latencies overlap
// (InputBlock waits for the totals, then for the streams, a thread at a time per position). N ≤
// kTiledMaxStreams, H a multiple of 4, the arrays 16-byte aligned.
__device__ void InputBlockVec(const HyperConnectionArgs& a, const double* p, int splits, const float* x, int lo,
                              int hi, const HyperCollapseOutput& out, size_t t) {
  __shared__ float pre[kMaxStreams];
  __shared__ float inv_out;
  const int n = a.streams, H = a.hidden;
  const int d = lo + 4 * threadIdx.x;
  const bool on = d < hi;
  float4 xv[kTiledMaxStreams], wv = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
  for (int i = 0; i < kTiledMaxStreams; ++i) {
    xv[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (i < n && on) xv[i] = *reinterpret_cast<const float4*>(x + static_cast<size_t>(i) * H + d);
  }
  if (on && out.normed != nullptr) wv = *reinterpret_cast<const float4*>(out.norm_weight + d);
  InputBlockScales(a, p, splits, out, pre, &inv_out);
  if (!on) return;
  float y[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < kTiledMaxStreams; ++i) {
    if (i < n) {
      y[0] += pre[i] * xv[i].x;
      y[1] += pre[i] * xv[i].y;
      y[2] += pre[i] * xv[i].z;
      y[3] += pre[i] * xv[i].w;
    }
  }
  *reinterpret_cast<float4*>(out.block_input + t * H + d) = make_float4(y[0], y[1], y[2], y[3]);
  if (out.normed != nullptr) {
    const float io = inv_out;
    *reinterpret_cast<float4*>(out.normed + t * H + d) =
        make_float4(wv.x * (y[0] * io), wv.y * (y[1] * io), wv.z * (y[2] * io), wv.w * (y[3] * io));
  }
}

// grid (T, input_blocks + mix), mix 0 or 1; block kThreads. partial [T, SumRows(N), splits] fp64 as
// MixSumsKernel wrote it; streams [T, N, H] fp32 (after its expand). Blocks y < input_blocks write
// out.block_input [T, H] fp32 and out.normed [T, H] fp32 at [y · span, (y + 1) · span)
// (InputBlock); block input_blocks, where the grid has it, out.post [T, N] and out.comb [T, N, N]
// fp32 (MixWarp, on its first warp; otherwise CollapseMixKernel forms them on a stream of their own).
// kVec: InputBlockVec (span 4 kThreads) instead of InputBlock.
template <bool kVec>
__global__ void __launch_bounds__(kThreads, 2)
    CollapseFinishKernel(HyperConnectionArgs a, const float* streams, const double* partial, int splits, int span,
                         int input_blocks, HyperCollapseOutput out) {
  exl3::cuda::PdlEnter();
  const size_t t = blockIdx.x;
  const double* p = partial + t * SumRows(a.streams) * splits;
  if (static_cast<int>(blockIdx.y) == input_blocks) {
    __shared__ MixWarpScratch w;
    if (threadIdx.x < 32) MixWarp(a, p, splits, out, t, w);
    return;
  }
  const int lo = blockIdx.y * span, hi = min(a.hidden, lo + span);
  if constexpr (kVec) {
    InputBlockVec(a, p, splits, streams + t * a.streams * a.hidden, lo, hi, out, t);
  } else {
    InputBlock(a, p, splits, streams + t * a.streams * a.hidden, lo, hi, out, t);
  }
}

// grid ceil(T / kMixWarps), block 32 · kMixWarps: a warp a token. partial [T, SumRows(N), splits]
// fp64 as MixSumsKernel wrote it → out.post [T, N] and out.comb [T, N, N] fp32 (MixWarp): a
// collapse's mix, which its own block does not read, on a stream forked from the collapse's
// (HyperMixStream). (A block a token left 7 of its 8 warps idle through the Sinkhorn steps, and at
// most 4 tokens' Sinkhorns a multiprocessor.)
constexpr int kMixWarps = 4;
__global__ void __launch_bounds__(32 * kMixWarps)
    CollapseMixKernel(HyperConnectionArgs a, const double* partial, int splits, int T, HyperCollapseOutput out) {
  __shared__ MixWarpScratch w[kMixWarps];
  const int warp = threadIdx.x / 32;
  const size_t t = static_cast<size_t>(blockIdx.x) * kMixWarps + warp;
  if (t >= static_cast<size_t>(T)) return;
  MixWarp(a, partial + t * SumRows(a.streams) * splits, splits, out, t, w[warp]);
}

// ---------------------------------------------------------------------------------------------
// Expand, heads, broadcast: a token's hidden vector split over blocks.

// Blocks a token's hidden vector is split over (a block per 256 elements: one per token is far
// too few for one decode token).
int HiddenBlocks(int H) { return std::min((H + kThreads - 1) / kThreads, 64); }

// A thread's elements of a hidden vector split over gridDim.y blocks: from HiddenFirst() on, every
// HiddenStride()-th.
__device__ __forceinline__ int HiddenFirst() { return blockIdx.y * blockDim.x + threadIdx.x; }
__device__ __forceinline__ int HiddenStride() { return gridDim.y * blockDim.x; }

// grid (T, HiddenBlocks(H)), block kThreads. In place on streams [T, N, H]; post [T, N], comb
// [T, N, N], o [T, H].
__global__ void ExpandKernel(const float* post, const float* comb, const float* o, int n, int H,
                             float* streams) {
  exl3::cuda::PdlEnter();
  __shared__ float p[kMaxStreams], c[kMaxStreams * kMaxStreams];
  const size_t t = blockIdx.x;
  for (int i = threadIdx.x; i < n; i += blockDim.x) p[i] = post[t * n + i];
  for (int i = threadIdx.x; i < n * n; i += blockDim.x) c[i] = comb[t * n * n + i];
  __syncthreads();
  float* s = streams + t * n * H;
  const float* ot = o + t * H;
  for (int d = HiddenFirst(); d < H; d += HiddenStride()) ExpandAt(s, H, d, n, p, c, ot[d], [](int, float) {});
}

// ExpandKernel four positions a thread (float4s): grid (T, ceil(H / (4 kThreads)) at most 64),
// ExpandAt's arithmetic per position. N ≤ kTiledMaxStreams, H a multiple of 4, the arrays 16-byte
// aligned (a thread a position moved its token's streams 4 bytes a load and spent as much on the
// block's start as on its work).
__global__ void ExpandVecKernel(const float* post, const float* comb, const float* o, int n, int H, float* streams) {
  exl3::cuda::PdlEnter();
  __shared__ float p[kMaxStreams], c[kMaxStreams * kMaxStreams];
  const size_t t = blockIdx.x;
  for (int i = threadIdx.x; i < n; i += blockDim.x) p[i] = post[t * n + i];
  for (int i = threadIdx.x; i < n * n; i += blockDim.x) c[i] = comb[t * n * n + i];
  __syncthreads();
  float* s = streams + t * n * H;
  const float* ot = o + t * H;
  for (int d = 4 * HiddenFirst(); d < H; d += 4 * HiddenStride()) {
    float4 in[kTiledMaxStreams];
#pragma unroll
    for (int j = 0; j < kTiledMaxStreams; ++j) {
      if (j < n) in[j] = *reinterpret_cast<const float4*>(s + static_cast<size_t>(j) * H + d);
    }
    const float4 od = *reinterpret_cast<const float4*>(ot + d);
#pragma unroll
    for (int k = 0; k < kTiledMaxStreams; ++k) {
      if (k < n) {
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int j = 0; j < kTiledMaxStreams; ++j) {
          if (j < n) {
            const float cjk = c[j * n + k];
            acc.x += cjk * in[j].x;
            acc.y += cjk * in[j].y;
            acc.z += cjk * in[j].z;
            acc.w += cjk * in[j].w;
          }
        }
        const float pk = p[k];
        *reinterpret_cast<float4*>(s + static_cast<size_t>(k) * H + d) =
            make_float4(pk * od.x + acc.x, pk * od.y + acc.y, pk * od.z + acc.z, pk * od.w + acc.w);
      }
    }
  }
}

// grid R, block kThreads; dynamic shared: N floats. streams [T, N, H]; rows [R]; out [R, H].
__global__ void HeadCollapseKernel(const float* fn, const float* base, float scale, int n, int H, float eps,
                                   float norm_eps, const float* streams, const int32_t* rows, float* out) {
  extern __shared__ float head_smem[];
  __shared__ double partial[32];
  const int width = n * H;
  const float* x = streams + static_cast<size_t>(rows != nullptr ? rows[blockIdx.x] : blockIdx.x) * width;
  NormedMixes(x, width, norm_eps, fn, n, head_smem, partial);
  float* y = out + static_cast<size_t>(blockIdx.x) * H;
  for (int d = threadIdx.x; d < H; d += blockDim.x) {
    float acc = 0.0f;
    for (int i = 0; i < n; ++i) {
      const float pre = SigmoidF(head_smem[i] * scale + base[i]) + eps;
      acc += pre * x[static_cast<size_t>(i) * H + d];
    }
    y[d] = acc;
  }
}

// grid (R, HiddenBlocks(H)), block kThreads. streams [T, N, H]; rows [R] (null: 0 .. R - 1); out
// [R, out_stride] = the mean of row rows[r]'s streams, summed in stream order and divided by N as
// HyperHead::Collapse's kMean does.
__global__ void MeanCollapseKernel(int n, int H, const float* streams, const int32_t* rows, float* out,
                                   int out_stride) {
  const float* x = streams + static_cast<size_t>(rows != nullptr ? rows[blockIdx.x] : blockIdx.x) * n * H;
  float* y = out + static_cast<size_t>(blockIdx.x) * out_stride;
  for (int d = HiddenFirst(); d < H; d += HiddenStride()) {
    float acc = 0.0f;
    for (int i = 0; i < n; ++i) acc += x[static_cast<size_t>(i) * H + d];
    y[d] = acc / static_cast<float>(n);
  }
}

// grid (T, HiddenBlocks(H)), block kThreads.
__global__ void BroadcastKernel(const float* x, int n, int H, float* streams) {
  const size_t t = blockIdx.x;
  for (int d = HiddenFirst(); d < H; d += HiddenStride()) {
    const float v = x[t * H + d];
    for (int k = 0; k < n; ++k) streams[(t * n + k) * H + d] = v;
  }
}

absl::Status CheckStreams(int n) {
  if (n < 1 || n > kMaxStreams)
    return absl::InvalidArgumentError(absl::StrCat("hyper-connections: ", n, " streams (1 to ", kMaxStreams,
                                                   " on the GPU)"));
  return absl::OkStatus();
}

int CeilDiv(int a, int b) { return (a + b - 1) / b; }

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Hidden positions of one MixSumsKernel block for T tokens: about kSliceTargetBlocks blocks in all,
// a multiple of 16 (float4s, 64-byte rows of fn), at most what a pass's products and the staged
// inputs hold (N · slice ≤ kPairSlots).
int CollapseSlice(int H, int T, int n) {
  const int most = std::min(kMaxSlice, kPairSlots / n) / 16 * 16;
  const long long want = (static_cast<long long>(H) * T + kSliceTargetBlocks - 1) / kSliceTargetBlocks;
  return static_cast<int>(std::clamp<long long>((want + 15) / 16 * 16, 16, most));
}

// Passes (kChunk hidden positions each) of one MixSumsTiledKernel block for T tokens: the most
// (up to kTiledMaxChunks) that still give about kTiledTargetBlocks blocks, so that few partial sums
// are left to total while every multiprocessor has a few blocks.
int TiledChunks(int H, int T) {
  const long long tiles = CeilDiv(T, kTileTokens), passes = CeilDiv(H, kChunk);
  int chunks = kTiledMaxChunks;
  while (chunks > 1 && tiles * ((passes + chunks - 1) / chunks) < kTiledTargetBlocks) chunks /= 2;
  return chunks;
}

// Whether a collapse of T tokens may take MixSumsTiledKernel by its shape (the arrays' alignment
// is checked at the launch).
bool TiledShape(int H, int T, int n) { return T >= kTiledMinTokens && n <= kTiledMaxStreams && H % 4 == 0; }

// How a collapse's sums are split: tiled (MixSumsTiledKernel, `chunks` passes a block) or not
// (MixSumsKernel), and the splits of each token's sums (its partial sums a row).
struct CollapsePlan {
  bool tiled = false;
  int slice = 0, splits = 0, chunks = 0;
};
CollapsePlan PlanCollapse(int H, int T, int n, bool aligned) {
  CollapsePlan p;
  p.tiled = aligned && TiledShape(H, T, n);
  if (p.tiled) {
    p.chunks = TiledChunks(H, T);
    p.slice = p.chunks * kChunk;
  } else {
    p.slice = CollapseSlice(H, T, n);
  }
  p.splits = CeilDiv(H, p.slice);
  return p;
}

}  // namespace

size_t HyperCollapseScratchDoubles(const HyperConnectionArgs& a, int T) {
  // The splits shrink as T grows; a call with fewer tokens may use more a token. Either kernel may
  // run (the tiled one only where the arrays are aligned).
  size_t most = 0;
  for (int t = 1; t <= T; ++t) {
    for (const bool aligned : {false, true}) {
      most = std::max(most, static_cast<size_t>(t) * PlanCollapse(a.hidden, t, a.streams, aligned).splits);
    }
  }
  return most * SumRows(a.streams);
}

absl::StatusOr<std::unique_ptr<HyperMixStream>> HyperMixStream::Create() {
  std::unique_ptr<HyperMixStream> m(new HyperMixStream());
  cudaStream_t side;
  EXL3_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  m->side_ = side;
  for (void** event : {&m->forked_, &m->done_}) {
    cudaEvent_t e;
    EXL3_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    *event = e;
  }
  return m;
}

HyperMixStream::~HyperMixStream() {
  if (side_ != nullptr) cudaStreamSynchronize(S(side_));
  for (void* e : {forked_, done_})
    if (e != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(e));
  if (side_ != nullptr) cudaStreamDestroy(S(side_));
}

absl::Status HyperMixStream::Join(StreamHandle stream) {
  if (!pending_) return absl::OkStatus();
  pending_ = false;
  EXL3_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(S(stream), static_cast<cudaEvent_t>(done_), 0));
  return absl::OkStatus();
}

absl::StatusOr<StreamHandle> HyperMixStream::Fork(StreamHandle stream) {
  EXL3_CUDA_RETURN_IF_ERROR(cudaEventRecord(static_cast<cudaEvent_t>(forked_), S(stream)));
  EXL3_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(S(side_), static_cast<cudaEvent_t>(forked_), 0));
  return side_;
}

absl::Status HyperMixStream::Forked() {
  EXL3_CUDA_RETURN_IF_ERROR(cudaEventRecord(static_cast<cudaEvent_t>(done_), S(side_)));
  pending_ = true;
  return absl::OkStatus();
}

absl::Status HyperCollapse(const HyperConnectionArgs& a, const HyperExpandInput* expand, float* streams, int T,
                           const HyperCollapseOutput& out, double* scratch, StreamHandle stream,
                           HyperMixStream* mix_stream) {
  if (T == 0) return absl::OkStatus();
  if (absl::Status st = CheckStreams(a.streams); !st.ok()) return st;
  if (out.normed != nullptr && out.norm_weight == nullptr)
    return absl::InvalidArgumentError("hyper-connection collapse: a normed output needs the norm's weight");
  // The last forked mix still reads the scratch the sums below write, and writes the post / comb
  // an expand reads.
  if (mix_stream != nullptr) EXL3_RETURN_IF_ERROR(mix_stream->Join(stream));
  const int n = a.streams, H = a.hidden;
  const HyperExpandInput ex = expand != nullptr ? *expand : HyperExpandInput{};
  const bool vector = H % 4 == 0 && Aligned16(a.fn);
  const bool aligned = vector && Aligned16(streams) && (ex.post == nullptr || Aligned16(ex.block_output));
  const CollapsePlan plan = PlanCollapse(H, T, n, aligned);
  const int splits = plan.splits;
  if (plan.tiled) {
    // Above 48 KiB a kernel must opt in, on each device: at every launch (a host call, no more;
    // allowed while a graph is captured).
    auto* const kernel = ex.post != nullptr ? MixSumsTiledKernel<true> : MixSumsTiledKernel<false>;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kTiledSmemBytes)) !=
        cudaSuccess)
      return LaunchStatus("hyper-connection mix sums: shared memory limit");
    exl3::cuda::LaunchPdlWithSmem(kernel, dim3(CeilDiv(T, kTileTokens), splits), dim3(kThreads), kTiledSmemBytes,
                                  S(stream), a.fn, n, H, T, plan.chunks, ex, streams, scratch);
  } else {
    exl3::cuda::LaunchPdl(vector ? MixSumsKernel<true> : MixSumsKernel<false>, dim3(T, splits), dim3(kThreads),
                          S(stream), a.fn, n, H, plan.slice, ex, streams, scratch);
  }
  if (absl::Status st = LaunchStatus("hyper-connection mix sums"); !st.ok()) return st;
  // The block input four positions a thread where the arrays allow (a block a 4 kThreads
  // positions), else one (blocks of kFinishSpan, at most kMaxFinishBlocks a token).
  const bool vec_finish = n <= kTiledMaxStreams && H % 4 == 0 && Aligned16(streams) && Aligned16(out.block_input) &&
                          (out.normed == nullptr || (Aligned16(out.normed) && Aligned16(out.norm_weight)));
  const int finish = vec_finish ? CeilDiv(H, 4 * kThreads) : std::clamp(CeilDiv(H, kFinishSpan), 1, kMaxFinishBlocks);
  const int span = vec_finish ? 4 * kThreads : CeilDiv(H, finish);
  if (mix_stream != nullptr) {
    EXL3_ASSIGN_OR_RETURN(const StreamHandle side, mix_stream->Fork(stream));
    CollapseMixKernel<<<CeilDiv(T, kMixWarps), 32 * kMixWarps, 0, S(side)>>>(a, static_cast<const double*>(scratch),
                                                                            splits, T, out);
    EXL3_RETURN_IF_ERROR(LaunchStatus("hyper-connection mix"));
    EXL3_RETURN_IF_ERROR(mix_stream->Forked());
  }
  const int mix_block = mix_stream == nullptr ? 1 : 0;
  exl3::cuda::LaunchPdl(vec_finish ? CollapseFinishKernel<true> : CollapseFinishKernel<false>,
                        dim3(T, finish + mix_block), dim3(kThreads), S(stream), a, static_cast<const float*>(streams),
                        static_cast<const double*>(scratch), splits, span, finish, out);
  return LaunchStatus("hyper-connection collapse");
}

absl::Status HyperExpand(const float* post, const float* comb, const float* block_output, int T, int n,
                         int hidden, float* streams, StreamHandle stream) {
  if (T == 0) return absl::OkStatus();
  if (absl::Status st = CheckStreams(n); !st.ok()) return st;
  if (n <= kTiledMaxStreams && hidden % 4 == 0 && Aligned16(streams) && Aligned16(block_output)) {
    exl3::cuda::LaunchPdl(ExpandVecKernel, dim3(T, std::min(CeilDiv(hidden, 4 * kThreads), 64)), dim3(kThreads),
                          S(stream), post, comb, block_output, n, hidden, streams);
  } else {
    exl3::cuda::LaunchPdl(ExpandKernel, dim3(T, HiddenBlocks(hidden)), dim3(kThreads), S(stream), post, comb,
                          block_output, n, hidden, streams);
  }
  return LaunchStatus("hyper-connection expand");
}

absl::Status HyperHeadCollapse(const float* fn, const float* base, float scale, int n, int hidden, float eps,
                               float norm_eps, const float* streams, const int32_t* rows, int R, float* out,
                               StreamHandle stream) {
  if (R == 0) return absl::OkStatus();
  if (absl::Status st = CheckStreams(n); !st.ok()) return st;
  HeadCollapseKernel<<<R, kThreads, n * sizeof(float), S(stream)>>>(fn, base, scale, n, hidden, eps, norm_eps,
                                                                    streams, rows, out);
  return LaunchStatus("hyper-connection head");
}

absl::Status HyperMeanCollapse(int n, int hidden, const float* streams, const int32_t* rows, int R, float* out,
                               StreamHandle stream, int out_stride) {
  if (R == 0) return absl::OkStatus();
  if (absl::Status st = CheckStreams(n); !st.ok()) return st;
  MeanCollapseKernel<<<dim3(R, HiddenBlocks(hidden)), kThreads, 0, S(stream)>>>(n, hidden, streams, rows, out,
                                                                                out_stride > 0 ? out_stride : hidden);
  return LaunchStatus("hyper-connection mean head");
}

absl::Status BroadcastStreams(const float* x, int T, int n, int hidden, float* streams, StreamHandle stream) {
  if (T == 0) return absl::OkStatus();
  if (absl::Status st = CheckStreams(n); !st.ok()) return st;
  BroadcastKernel<<<dim3(T, HiddenBlocks(hidden)), kThreads, 0, S(stream)>>>(x, n, hidden, streams);
  return LaunchStatus("hyper-connection streams");
}

}  // namespace exl3::engine::cuda
