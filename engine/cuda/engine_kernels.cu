#include "engine/cuda/engine_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "engine/cuda/launch_status.cuh"
#include "kernels/cuda/launch.cuh"

namespace exl3::engine::cuda {
namespace {

constexpr int kThreads = 256;

// Sum over the block of a double held by every thread (blockDim.x a multiple of 32, ≤ 1024).
__device__ double BlockSum(double v) {
  __shared__ double partial[32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // partial may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  const int warps = blockDim.x / 32;
  double total = 0.0;
  for (int w = 0; w < warps; ++w) total += partial[w];
  return total;
}

__device__ float BlockMax(float v) {
  __shared__ float partial[32];
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  float m = -INFINITY;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) m = fmaxf(m, partial[w]);
  return m;
}

// ---------------------------------------------------------------------------------------------
// Embeddings, norms, elementwise.

template <typename T>
__device__ float ToFloat(T v);
template <>
__device__ float ToFloat<float>(float v) { return v; }
template <>
__device__ float ToFloat<__half>(__half v) { return __half2float(v); }
template <>
__device__ float ToFloat<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

// grid T, block kThreads. table [vocab, hidden] of T; ids [T]; out [T, hidden] fp32.
template <typename T>
__global__ void EmbedKernel(const T* __restrict__ table, const int32_t* ids, int hidden,
                            float* __restrict__ out) {
  exl3::cuda::PdlEnter();
  const size_t base = static_cast<size_t>(ids[blockIdx.x]) * hidden;
  float* row = out + static_cast<size_t>(blockIdx.x) * hidden;
#pragma unroll 8
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) row[i] = ToFloat(table[base + i]);
}

// grid rows, block kThreads. Row r of the output is rmsnorm(x[src_row]) * w with src_row =
// row_map ? row_map[r] : r; with `residual`, x[src_row] += residual[src_row] first (x written).
// x, residual [*, n]; w [n]; y [rows, n] (may alias x when row_map is null). The general case.
__global__ void RmsNormKernel(float* x, const float* residual, const int32_t* row_map,
                              const float* w, int n, float eps, float* y) {
  exl3::cuda::PdlEnter();
  const int src = row_map != nullptr ? row_map[blockIdx.x] : blockIdx.x;
  float* xr = x + static_cast<size_t>(src) * n;
  float* yr = y + static_cast<size_t>(blockIdx.x) * n;
  double ss = 0.0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    float v = xr[i];
    if (residual != nullptr) {
      v += residual[static_cast<size_t>(src) * n + i];
      xr[i] = v;
    }
    ss += static_cast<double>(v) * v;
  }
  ss = BlockSum(ss);
  const float inv = static_cast<float>(1.0 / sqrt(ss / n + eps));
  for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = w[i] * (xr[i] * inv);
}

// The same for rows of n = 4 * j floats, j <= V * kThreads, 16-byte aligned: each thread holds its
// V float4 of the row in registers, so every load of the row is issued before the first store
// (the general kernel's loop waits on memory once per element: ~13 us for one 4096-float row).
template <int V>
__global__ void RmsNormVecKernel(float* x, const float* residual, const int32_t* row_map,
                                 const float* w, int n, float eps, float* y) {
  exl3::cuda::PdlEnter();
  const int src = row_map != nullptr ? row_map[blockIdx.x] : blockIdx.x;
  const int n4 = n / 4;
  float4* xr = reinterpret_cast<float4*>(x + static_cast<size_t>(src) * n);
  float4 v[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int i = threadIdx.x + j * kThreads;
    v[j] = i < n4 ? xr[i] : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  if (residual != nullptr) {
    const float4* rr = reinterpret_cast<const float4*>(residual + static_cast<size_t>(src) * n);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int i = threadIdx.x + j * kThreads;
      if (i < n4) {
        const float4 r = rr[i];
        v[j] = make_float4(v[j].x + r.x, v[j].y + r.y, v[j].z + r.z, v[j].w + r.w);
        xr[i] = v[j];
      }
    }
  }
  double ss = 0.0;
#pragma unroll
  for (int j = 0; j < V; ++j)
    ss += static_cast<double>(v[j].x) * v[j].x + static_cast<double>(v[j].y) * v[j].y +
          static_cast<double>(v[j].z) * v[j].z + static_cast<double>(v[j].w) * v[j].w;
  ss = BlockSum(ss);
  const float inv = static_cast<float>(1.0 / sqrt(ss / n + eps));
  const float4* w4 = reinterpret_cast<const float4*>(w);
  float4* yr = reinterpret_cast<float4*>(y + static_cast<size_t>(blockIdx.x) * n);
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int i = threadIdx.x + j * kThreads;
    if (i < n4) {
      const float4 g = w4[i];
      yr[i] = make_float4(g.x * (v[j].x * inv), g.y * (v[j].y * inv), g.z * (v[j].z * inv),
                          g.w * (v[j].w * inv));
    }
  }
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The norm of `rows` rows (RmsNormKernel's arguments), vectorised where the shape allows.
void LaunchRmsNorm(float* x, const float* residual, const int32_t* row_map, const float* w, int rows,
                   int n, float eps, float* y, cudaStream_t stream) {
  const bool vec = n % 4 == 0 && Aligned16(x) && Aligned16(w) && Aligned16(y) &&
                   (residual == nullptr || Aligned16(residual));
  const int per_thread = (n / 4 + kThreads - 1) / kThreads;
  if (vec && per_thread <= 1) {
    exl3::cuda::LaunchPdlWithSmem(RmsNormVecKernel<1>, dim3(rows), dim3(kThreads), 0, stream, x, residual, row_map, w,
                                  n, eps, y);
  } else if (vec && per_thread <= 4) {
    exl3::cuda::LaunchPdlWithSmem(RmsNormVecKernel<4>, dim3(rows), dim3(kThreads), 0, stream, x, residual, row_map, w,
                                  n, eps, y);
  } else if (vec && per_thread <= 8) {
    exl3::cuda::LaunchPdlWithSmem(RmsNormVecKernel<8>, dim3(rows), dim3(kThreads), 0, stream, x, residual, row_map, w,
                                  n, eps, y);
  } else {
    exl3::cuda::LaunchPdlWithSmem(RmsNormKernel, dim3(rows), dim3(kThreads), 0, stream, x, residual, row_map, w, n, eps,
                                  y);
  }
}

__global__ void AddKernel(float* h, const float* d, int64_t n) {
  exl3::cuda::PdlEnter();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    h[i] += d[i];
}

// Block r copies row rows[r] of x into row r of out.
__global__ void GatherRowsKernel(const float* x, const int32_t* rows, int n, float* out) {
  exl3::cuda::PdlEnter();
  const float* src = x + static_cast<int64_t>(rows[blockIdx.x]) * n;
  float* dst = out + static_cast<int64_t>(blockIdx.x) * n;
  for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

__global__ void SiluMulKernel(float* gate, const float* up, int64_t n) {
  exl3::cuda::PdlEnter();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = gate[i];
    gate[i] = g / (1.0f + expf(-g)) * up[i];
  }
}

// SiluMulKernel with the clamp of kernels/moe_cpu.h's SwiGlu: gate <= limit, up in [-limit, limit].
__global__ void ClampedSiluMulKernel(float* gate, const float* up, int64_t n, float limit) {
  exl3::cuda::PdlEnter();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = fminf(gate[i], limit);
    const float u = fminf(fmaxf(up[i], -limit), limit);
    gate[i] = g / (1.0f + expf(-g)) * u;
  }
}

// Grid-stride over rows * head_dim: qg [rows, 2 * head_dim] (per head the query, then its gate)
// -> q, gate [rows, head_dim].
__global__ void SplitQueryGateKernel(const float* qg, int64_t rows, int head_dim, float* q,
                                     float* gate) {
  exl3::cuda::PdlEnter();
  const int64_t n = rows * head_dim;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / head_dim, d = i % head_dim;
    q[i] = qg[r * 2 * head_dim + d];
    gate[i] = qg[r * 2 * head_dim + head_dim + d];
  }
}

// Grid-stride: x[i] *= sigmoid(gate[i]).
__global__ void SigmoidGateKernel(float* x, const float* gate, int64_t n) {
  exl3::cuda::PdlEnter();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] *= 1.0f / (1.0f + expf(-gate[i]));
}

// grid T, block kThreads. y [T, out] += bias [out].
__global__ void AddBiasKernel(float* y, const float* bias, int out_features) {
  exl3::cuda::PdlEnter();
  float* row = y + static_cast<size_t>(blockIdx.x) * out_features;
  for (int i = threadIdx.x; i < out_features; i += blockDim.x) row[i] += bias[i];
}

int ElementwiseBlocks(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 4096 ? (blocks > 0 ? blocks : 1) : 4096);
}

// ---------------------------------------------------------------------------------------------
// RoPE.

// grid (T, heads), block min(rotary_dim / 2, 128); dynamic shared: rotary_dim floats.
__global__ void RopeKernel(float* x, int row_stride, int head_stride, int rotary_dim,
                           bool interleaved, const float* cos, const float* sin) {
  exl3::cuda::PdlEnter();
  extern __shared__ float rotated[];
  const int t = blockIdx.x, half = rotary_dim / 2;
  float* v = x + static_cast<size_t>(t) * row_stride + static_cast<size_t>(blockIdx.y) * head_stride;
  const float* c = cos + static_cast<size_t>(t) * half;
  const float* s = sin + static_cast<size_t>(t) * half;
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const float a = interleaved ? v[2 * i] : v[i];
    const float b = interleaved ? v[2 * i + 1] : v[i + half];
    rotated[i] = a * c[i] - b * s[i];
    rotated[i + half] = b * c[i] + a * s[i];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < rotary_dim; i += blockDim.x) v[i] = rotated[i];
}

// ---------------------------------------------------------------------------------------------
// The MoE gate.

// The better of two (score, expert) candidates: higher score, then lower index.
__device__ inline bool Better(float v, int i, float bv, int bi) {
  return bi < 0 || v > bv || (v == bv && i < bi);
}

// Best candidate over `choice` [n] skipping taken[], by one warp; every lane gets the answer.
__device__ int WarpArgMax(const float* choice, const unsigned char* taken, int n) {
  const int lane = threadIdx.x % 32;
  float bv = -INFINITY;
  int bi = -1;
  for (int e = lane; e < n; e += 32)
    if (!taken[e] && Better(choice[e], e, bv, bi)) bv = choice[e], bi = e;
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (oi >= 0 && Better(ov, oi, bv, bi)) bv = ov, bi = oi;
  }
  return bi;
}

// Experts up to which RouteKernel keeps its top-k candidates in registers (16 a lane).
constexpr int kRouteRegisterExperts = 512;

__device__ inline float Softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// grid T, block kThreads; dynamic shared: 2 * E floats + E bytes (+ groups). logits [T, E];
// ids, weights [T, k].
__global__ void RouteKernel(GateConfig cfg, const float* logits, const float* bias, int32_t* ids,
                            float* weights) {
  exl3::cuda::PdlEnter();
  extern __shared__ float gate_smem[];
  const int E = cfg.num_experts, k = cfg.top_k;
  float* score = gate_smem;          // what the weights are taken from
  float* choice = score + E;         // what the experts are chosen by
  float* group_score = choice + E;   // [n_group]
  unsigned char* taken = reinterpret_cast<unsigned char*>(group_score + cfg.n_group);
  const float* l = logits + static_cast<size_t>(blockIdx.x) * E;

  if (cfg.scoring == ScoringFunc::kSoftmax) {
    float mx = -INFINITY;
    for (int e = threadIdx.x; e < E; e += blockDim.x) mx = fmaxf(mx, l[e]);
    mx = BlockMax(mx);
    double sum = 0.0;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      const float p = expf(l[e] - mx);
      score[e] = p;
      sum += p;
    }
    sum = BlockSum(sum);
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      score[e] = static_cast<float>(score[e] / sum);
      choice[e] = score[e];
      taken[e] = 0;
    }
  } else {
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      const float v = cfg.scoring == ScoringFunc::kSigmoid ? 1.0f / (1.0f + expf(-l[e]))
                                                                   : sqrtf(Softplus(l[e]));
      score[e] = v;
      choice[e] = v + (bias != nullptr ? bias[e] : 0.0f);
      taken[e] = 0;
    }
  }
  __syncthreads();
  if (cfg.scoring != ScoringFunc::kSoftmax && cfg.n_group > 1 && cfg.topk_group < cfg.n_group) {
    const int G = cfg.n_group, per = E / G;
    for (int g = threadIdx.x; g < G; g += blockDim.x) {
      float a = -INFINITY, b = -INFINITY;
      for (int e = g * per; e < (g + 1) * per; ++e) {
        const float v = choice[e];
        if (v > a) {
          b = a;
          a = v;
        } else if (v > b) {
          b = v;
        }
      }
      group_score[g] = a + b;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      // Groups kept: the topk_group best (ties: lower group), marked in taken[] temporarily.
      unsigned long long kept = 0;
      for (int r = 0; r < cfg.topk_group; ++r) {
        int best = -1;
        for (int g = 0; g < G; ++g)
          if (!(kept >> g & 1ull) && Better(group_score[g], g, best >= 0 ? group_score[best] : 0.0f, best)) best = g;
        kept |= 1ull << best;
      }
      for (int g = 0; g < G; ++g) group_score[g] = (kept >> g & 1ull) ? 1.0f : 0.0f;
    }
    __syncthreads();
    // Experts of the dropped groups cannot be chosen (-inf, as transformers 5.x and model/routing.cc).
    for (int e = threadIdx.x; e < E; e += blockDim.x)
      if (group_score[e / per] == 0.0f) choice[e] = -INFINITY;
    __syncthreads();
  }
  // The top k by the first warp alone: k rounds of a warp argmax, with no block barrier per round
  // (k block-wide rounds cost ~1 us each). Up to kRouteRegisterExperts experts the candidates sit
  // in registers (lane l holds experts l, l + 32, ...; a bit per taken one), else in shared memory.
  if (threadIdx.x >= 32) return;
  __shared__ int chosen[64];
  if (E <= kRouteRegisterExperts) {
    const int lane = threadIdx.x;
    float v[kRouteRegisterExperts / 32];
#pragma unroll
    for (int j = 0; j < kRouteRegisterExperts / 32; ++j) v[j] = lane + 32 * j < E ? choice[lane + 32 * j] : -INFINITY;
    unsigned taken_bits = 0;
    for (int r = 0; r < k; ++r) {
      float bv = -INFINITY;
      int bi = -1;
#pragma unroll
      for (int j = 0; j < kRouteRegisterExperts / 32; ++j) {
        const int e = lane + 32 * j;
        if (e < E && !(taken_bits >> j & 1u) && Better(v[j], e, bv, bi)) bv = v[j], bi = e;
      }
      for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (oi >= 0 && Better(ov, oi, bv, bi)) bv = ov, bi = oi;
      }
      if (bi % 32 == lane) taken_bits |= 1u << (bi / 32);
      if (lane == 0) chosen[r] = bi;
    }
    __syncwarp();
  } else {
    for (int r = 0; r < k; ++r) {
      const int best = WarpArgMax(choice, taken, E);
      __syncwarp();  // every lane's reads of taken[] are done before lane 0 writes it
      if (threadIdx.x == 0) {
        chosen[r] = best;
        taken[best] = 1;
      }
      __syncwarp();
    }
  }
  if (threadIdx.x == 0) {
    int32_t* out_ids = ids + static_cast<size_t>(blockIdx.x) * k;
    float* out_w = weights + static_cast<size_t>(blockIdx.x) * k;
    float sum = 0.0f;
    for (int r = 0; r < k; ++r) {
      out_ids[r] = chosen[r];
      out_w[r] = score[chosen[r]];
      sum += out_w[r];
    }
    const float denom = cfg.scoring == ScoringFunc::kSoftmax ? sum : sum + 1e-20f;
    for (int r = 0; r < k; ++r) {
      if (cfg.norm_topk_prob) out_w[r] /= denom;
      out_w[r] *= cfg.routed_scaling_factor;
    }
  }
}

// grid T, one warp's worth of threads (lane 0 works: k is small). logits [T, E]; tid2eid
// [vocab, k]; token_ids [T]; ids, weights [T, k].
__global__ void HashRouteKernel(GateConfig cfg, const float* logits, const int32_t* tid2eid,
                                const int32_t* token_ids, int32_t* ids, float* weights) {
  exl3::cuda::PdlEnter();
  if (threadIdx.x != 0) return;
  const int k = cfg.top_k, E = cfg.num_experts;
  const size_t t = blockIdx.x;
  const float* l = logits + t * E;
  const int32_t* row = tid2eid + static_cast<size_t>(token_ids[t]) * k;
  int32_t* out_ids = ids + t * k;
  float* out_w = weights + t * k;
  float sum = 0.0f;
  for (int i = 0; i < k; ++i) {
    const int32_t e = row[i];
    out_ids[i] = e;
    out_w[i] = cfg.scoring == ScoringFunc::kSigmoid ? 1.0f / (1.0f + expf(-l[e])) : sqrtf(Softplus(l[e]));
    sum += out_w[i];
  }
  for (int i = 0; i < k; ++i) {
    if (cfg.norm_topk_prob) out_w[i] /= (sum + 1e-20f);
    out_w[i] *= cfg.routed_scaling_factor;
  }
}

}  // namespace

absl::Status EmbedRows(const void* table, EmbeddingDType dtype, const int32_t* ids, int T,
                       int hidden, float* out, StreamHandle stream) {
  if (T == 0) return absl::OkStatus();
  switch (dtype) {
    case EmbeddingDType::kF32:
      exl3::cuda::LaunchPdlWithSmem(EmbedKernel<float>, dim3(T), dim3(kThreads), 0, S(stream),
                                    static_cast<const float*>(table), ids, hidden, out);
      break;
    case EmbeddingDType::kF16:
      exl3::cuda::LaunchPdlWithSmem(EmbedKernel<__half>, dim3(T), dim3(kThreads), 0, S(stream),
                                    static_cast<const __half*>(table), ids, hidden, out);
      break;
    case EmbeddingDType::kBF16:
      exl3::cuda::LaunchPdlWithSmem(EmbedKernel<__nv_bfloat16>, dim3(T), dim3(kThreads), 0, S(stream),
                                    static_cast<const __nv_bfloat16*>(table), ids, hidden, out);
      break;
  }
  return LaunchStatus("embedding gather");
}

absl::Status RmsNorm(const float* x, const float* w, int rows, int n, float eps, float* y,
                     StreamHandle stream) {
  if (rows == 0) return absl::OkStatus();
  // x is only read without a residual.
  LaunchRmsNorm(const_cast<float*>(x), nullptr, nullptr, w, rows, n, eps, y, S(stream));
  return LaunchStatus("rmsnorm");
}

absl::Status AddRmsNorm(float* h, const float* d, const float* w, int rows, int n, float eps,
                        float* y, StreamHandle stream) {
  if (rows == 0) return absl::OkStatus();
  LaunchRmsNorm(h, d, nullptr, w, rows, n, eps, y, S(stream));
  return LaunchStatus("residual add + rmsnorm");
}

absl::Status GatherRmsNorm(const float* h, const int32_t* rows, int num_rows, const float* w,
                           int n, float eps, float* out, StreamHandle stream) {
  if (num_rows == 0) return absl::OkStatus();
  LaunchRmsNorm(const_cast<float*>(h), nullptr, rows, w, num_rows, n, eps, out, S(stream));
  return LaunchStatus("final rmsnorm");
}

absl::Status GatherRows(const float* x, const int32_t* rows, int num_rows, int n, float* out, StreamHandle stream) {
  if (num_rows == 0 || n == 0) return absl::OkStatus();
  exl3::cuda::LaunchPdlWithSmem(GatherRowsKernel, dim3(num_rows), dim3(kThreads), 0, S(stream), x, rows, n, out);
  return LaunchStatus("row gather");
}

absl::Status AddInPlace(float* h, const float* d, int64_t n, StreamHandle stream) {
  if (n == 0) return absl::OkStatus();
  exl3::cuda::LaunchPdlWithSmem(AddKernel, dim3(ElementwiseBlocks(n)), dim3(kThreads), 0, S(stream), h, d, n);
  return LaunchStatus("residual add");
}

absl::Status SiluMul(float* gate, const float* up, int64_t n, StreamHandle stream) {
  if (n == 0) return absl::OkStatus();
  exl3::cuda::LaunchPdlWithSmem(SiluMulKernel, dim3(ElementwiseBlocks(n)), dim3(kThreads), 0, S(stream), gate, up, n);
  return LaunchStatus("swiglu");
}

absl::Status ClampedSiluMul(float* gate, const float* up, int64_t n, float limit, StreamHandle stream) {
  if (!(limit > 0.0f) || !std::isfinite(limit))
    return absl::InvalidArgumentError(absl::StrCat("clamped swiglu: limit ", limit, " (must be finite and > 0)"));
  if (n == 0) return absl::OkStatus();
  exl3::cuda::LaunchPdlWithSmem(ClampedSiluMulKernel, dim3(ElementwiseBlocks(n)), dim3(kThreads), 0, S(stream), gate,
                                up, n, limit);
  return LaunchStatus("clamped swiglu");
}

absl::Status SplitQueryGate(const float* qg, int64_t rows, int head_dim, float* q, float* gate,
                            StreamHandle stream) {
  if (rows == 0) return absl::OkStatus();
  exl3::cuda::LaunchPdlWithSmem(SplitQueryGateKernel, dim3(ElementwiseBlocks(rows * head_dim)), dim3(kThreads), 0,
                                S(stream), qg, rows, head_dim, q, gate);
  return LaunchStatus("query/gate split");
}

absl::Status SigmoidGate(float* x, const float* gate, int64_t n, StreamHandle stream) {
  if (n == 0) return absl::OkStatus();
  exl3::cuda::LaunchPdlWithSmem(SigmoidGateKernel, dim3(ElementwiseBlocks(n)), dim3(kThreads), 0, S(stream), x, gate,
                                n);
  return LaunchStatus("output gate");
}

absl::Status AddBias(float* y, const float* bias, int T, int out_features, StreamHandle stream) {
  if (T == 0) return absl::OkStatus();
  exl3::cuda::LaunchPdlWithSmem(AddBiasKernel, dim3(T), dim3(kThreads), 0, S(stream), y, bias, out_features);
  return LaunchStatus("bias");
}

absl::Status ApplyRope(float* x, int T, int num_heads, int row_stride, int head_stride,
                       int rotary_dim, bool interleaved, const float* cos, const float* sin,
                       StreamHandle stream) {
  if (T == 0 || rotary_dim == 0) return absl::OkStatus();
  const int threads = rotary_dim / 2 < 128 ? ((rotary_dim / 2 + 31) / 32) * 32 : 128;
  exl3::cuda::LaunchPdlWithSmem(RopeKernel, dim3(T, num_heads), dim3(threads), rotary_dim * sizeof(float), S(stream), x,
                                row_stride, head_stride, rotary_dim, interleaved, cos, sin);
  return LaunchStatus("rope");
}

GateConfig GateConfigFor(const MoeConfig& m) {
  GateConfig g;
  g.scoring = m.scoring;
  g.num_experts = m.num_experts;
  g.top_k = m.top_k;
  g.n_group = m.n_group;
  g.topk_group = m.topk_group;
  g.norm_topk_prob = m.norm_topk_prob;
  g.routed_scaling_factor = m.routed_scaling_factor;
  return g;
}

absl::Status RouteOnDevice(const GateConfig& cfg, const float* logits, const float* bias, int T,
                           int32_t* ids, float* weights, StreamHandle stream) {
  if (T == 0) return absl::OkStatus();
  if (cfg.top_k < 1 || cfg.top_k > 64 || cfg.top_k > cfg.num_experts || cfg.n_group < 1 ||
      cfg.n_group > 64 || cfg.num_experts % cfg.n_group != 0)
    return absl::InvalidArgumentError(absl::StrCat("device gate: unsupported routing (", cfg.num_experts,
                                                   " experts, top-", cfg.top_k, ", ", cfg.n_group, " groups)"));
  const size_t smem = (2 * cfg.num_experts + cfg.n_group) * sizeof(float) + cfg.num_experts;
  exl3::cuda::LaunchPdlWithSmem(RouteKernel, dim3(T), dim3(kThreads), smem, S(stream), cfg, logits, bias, ids, weights);
  return LaunchStatus("device gate");
}

absl::Status HashRouteOnDevice(const GateConfig& cfg, const float* logits, const int32_t* tid2eid,
                               const int32_t* token_ids, int T, int32_t* ids, float* weights,
                               StreamHandle stream) {
  if (T == 0) return absl::OkStatus();
  if (cfg.top_k < 1 || cfg.top_k > cfg.num_experts)
    return absl::InvalidArgumentError(absl::StrCat("hash gate: top-", cfg.top_k, " of ", cfg.num_experts,
                                                   " experts"));
  exl3::cuda::LaunchPdlWithSmem(HashRouteKernel, dim3(T), dim3(32), 0, S(stream), cfg, logits, tid2eid, token_ids, ids,
                                weights);
  return LaunchStatus("hash gate");
}

}  // namespace exl3::engine::cuda
