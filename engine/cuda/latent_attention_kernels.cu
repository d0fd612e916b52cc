#include "engine/cuda/latent_attention_kernels.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "engine/cuda/launch_status.cuh"

namespace exl3::engine::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kHeadTile = 16;     // query heads per block (each cached position read once for them)
constexpr int kPositionTile = 16;  // cached positions staged in shared memory at a time

__device__ double BlockSumDouble(double v, double* partial /*[32]*/) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  double total = 0.0;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) total += partial[w];
  return total;
}

__global__ void WriteLatentKernel(const float* ckv, const float* w, int R, int rope, float eps,
                                  const int32_t* slot, __half* cache, int width) {
  __shared__ double partial[32];
  const int t = blockIdx.x;
  const float* c = ckv + static_cast<size_t>(t) * (R + rope);
  double ss = 0.0;
  for (int i = threadIdx.x; i < R; i += blockDim.x) ss += static_cast<double>(c[i]) * c[i];
  ss = BlockSumDouble(ss, partial);
  const float inv = static_cast<float>(1.0 / sqrt(ss / R + eps));
  __half* s = cache + static_cast<size_t>(slot[t]) * width;
  for (int i = threadIdx.x; i < R; i += blockDim.x) s[i] = __float2half_rn(w[i] * (c[i] * inv));
  for (int i = threadIdx.x; i < rope; i += blockDim.x) s[R + i] = __float2half_rn(c[R + i]);
}

// Shared memory of one attention block, in floats: the tile's queries [HT, W] (latent then rope
// part), the output accumulators [HT, R], the tile's scores [HT, P], each head's running max, sum
// and rescale [3, HT], the staged slots' indices [P] (ints), then the staged positions [P, W] fp16.
struct LatentSmem {
  int q, acc, scores, stats, slots, kv, floats;
  __host__ __device__ LatentSmem(int ht, int R, int W) {
    q = 0;
    acc = q + ht * W;
    scores = acc + ht * R;
    stats = scores + ht * kPositionTile;
    slots = stats + 3 * ht;
    kv = slots + kPositionTile;
    floats = kv + (kPositionTile * W + 1) / 2;
  }
};

__global__ void LatentAttentionKernel(const float* q_latent, const float* q, const __half* cache,
                                      AttentionTokens at, LatentSelection sel, bool selected,
                                      LatentAttentionShape shape, int head_tile, int splits,
                                      const int32_t* split_positions, float* scratch, float* out) {
  extern __shared__ float smem[];
  const int R = shape.latent_dim, W = R + shape.rope_dim, NH = shape.num_heads;
  const int t = blockIdx.z, split = blockIdx.y, h0 = blockIdx.x * head_tile;
  const int nh = min(head_tile, NH - h0);
  const LatentSmem lay(head_tile, R, W);
  float* qs = smem + lay.q;
  float* acc = smem + lay.acc;
  float* sc = smem + lay.scores;
  float* run_max = smem + lay.stats;
  float* run_sum = run_max + head_tile;
  float* rescale = run_sum + head_tile;
  int* slots = reinterpret_cast<int*>(smem + lay.slots);
  __half* kv = reinterpret_cast<__half*>(smem + lay.kv);

  const int pos = at.position[t], first = at.first_visible[t];
  const int32_t* list = selected ? sel.positions + static_cast<size_t>(t) * sel.stride : nullptr;
  const int n = selected ? sel.count[t] : pos - first + 1;
  const int per = *split_positions;
  const int i0 = split * per;
  const int i1 = split == splits - 1 ? n : min(n, i0 + per);
  const int32_t* table = at.tables + at.table_offset[t];
  const int bs = at.block_size;

  for (int e = threadIdx.x; e < nh * W; e += blockDim.x) {
    const int hh = e / W, d = e % W;
    const size_t head = static_cast<size_t>(t) * NH + h0 + hh;
    qs[hh * W + d] = d < R ? q_latent[head * R + d] : q[head * shape.q_stride + shape.rope_offset + (d - R)];
  }
  for (int e = threadIdx.x; e < nh * R; e += blockDim.x) acc[e] = 0.0f;
  if (threadIdx.x < nh) {
    run_max[threadIdx.x] = -INFINITY;
    run_sum[threadIdx.x] = 0.0f;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int base = i0; base < i1; base += kPositionTile) {
    const int np = min(kPositionTile, i1 - base);
    __syncthreads();  // the previous tile's kv and scores are consumed
    if (threadIdx.x < np) {
      const int p = list != nullptr ? list[base + threadIdx.x] : first + base + threadIdx.x;
      slots[threadIdx.x] = table[p / bs] * bs + p % bs;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < np * W; e += blockDim.x) {
      const int pp = e / W, d = e % W;
      kv[pp * W + d] = cache[static_cast<size_t>(slots[pp]) * shape.cache_width + d];
    }
    __syncthreads();
    for (int pair = warp; pair < nh * np; pair += warps) {
      const int hh = pair / np, pp = pair % np;
      const float* qh = qs + hh * W;
      const __half* k = kv + pp * W;
      float dot = 0.0f;
      for (int d = lane; d < W; d += 32) dot += qh[d] * __half2float(k[d]);
      for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      if (lane == 0) sc[hh * kPositionTile + pp] = dot * shape.scale;
    }
    __syncthreads();
    if (threadIdx.x < nh) {  // online softmax: one thread per head
      float* s = sc + threadIdx.x * kPositionTile;
      const float old_max = run_max[threadIdx.x];
      float m = old_max;
      for (int pp = 0; pp < np; ++pp) m = fmaxf(m, s[pp]);
      const float r = old_max == -INFINITY ? 0.0f : expf(old_max - m);
      float sum = 0.0f;
      for (int pp = 0; pp < np; ++pp) {
        s[pp] = expf(s[pp] - m);
        sum += s[pp];
      }
      run_max[threadIdx.x] = m;
      run_sum[threadIdx.x] = run_sum[threadIdx.x] * r + sum;
      rescale[threadIdx.x] = r;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < nh * R; e += blockDim.x) {
      const int hh = e / R, r = e % R;
      const float* p = sc + hh * kPositionTile;
      float a = acc[e] * rescale[hh];
      for (int pp = 0; pp < np; ++pp) a += p[pp] * __half2float(kv[pp * W + r]);
      acc[e] = a;
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < nh * R; e += blockDim.x) {
    const int hh = e / R, r = e % R;
    const size_t head = static_cast<size_t>(t) * NH + h0 + hh;
    if (splits == 1) {
      const float l = run_sum[hh];
      out[head * R + r] = l > 0.0f ? acc[e] / l : 0.0f;
    } else {
      float* part = scratch + (head * splits + split) * (R + 2);
      part[r] = acc[e];
      if (r == 0) {
        part[R] = run_max[hh];
        part[R + 1] = run_sum[hh];
      }
    }
  }
}

// out[t, h] from the splits' partials (max, sum, unnormalised output); grid (heads, T).
__global__ void LatentCombineKernel(const float* scratch, int NH, int R, int splits, float* out) {
  const size_t head = static_cast<size_t>(blockIdx.y) * NH + blockIdx.x;
  const float* part = scratch + head * splits * (R + 2);
  float m = -INFINITY;
  for (int s = 0; s < splits; ++s) m = fmaxf(m, part[s * (R + 2) + R]);
  float l = 0.0f;
  for (int s = 0; s < splits; ++s) {
    const float ms = part[s * (R + 2) + R];
    if (ms != -INFINITY) l += expf(ms - m) * part[s * (R + 2) + R + 1];
  }
  for (int r = threadIdx.x; r < R; r += blockDim.x) {
    float o = 0.0f;
    for (int s = 0; s < splits; ++s) {
      const float ms = part[s * (R + 2) + R];
      if (ms != -INFINITY) o += expf(ms - m) * part[s * (R + 2) + r];
    }
    out[head * R + r] = l > 0.0f ? o / l : 0.0f;
  }
}

}  // namespace

absl::Status WriteLatentToCache(const float* ckv, const float* w, int T, int R, int rope, float eps,
                                const int32_t* slot, KvHalf* cache_layer, int width, StreamHandle stream) {
  if (T == 0) return absl::OkStatus();
  if (R + rope > width) return absl::InvalidArgumentError("latent cache write: slot narrower than latent + rope key");
  WriteLatentKernel<<<T, kThreads, 0, S(stream)>>>(ckv, w, R, rope, eps, slot,
                                                   reinterpret_cast<__half*>(cache_layer), width);
  return LaunchStatus("latent cache write");
}

int LatentAttentionHeadTiles(int num_heads) { return (num_heads + kHeadTile - 1) / kHeadTile; }

int64_t LatentAttentionScratchFloats(int T, int NH, int R, int splits) {
  return splits > 1 ? static_cast<int64_t>(T) * NH * splits * (R + 2) : 0;
}

absl::Status LatentAttention(const float* q_latent, const float* q, const KvHalf* cache_layer,
                             const AttentionTokens& tokens, const LatentSelection* selection, int T,
                             const LatentAttentionShape& shape, int splits, const int32_t* split_positions,
                             float* scratch, float* out_latent, StreamHandle stream) {
  if (T == 0) return absl::OkStatus();
  if (T > 65535) return absl::InvalidArgumentError(absl::StrCat("latent attention: ", T, " tokens in one step (at most 65535)"));
  const int R = shape.latent_dim, W = R + shape.rope_dim;
  if (R <= 0 || shape.rope_dim < 0 || W > shape.cache_width || shape.num_heads <= 0 || splits < 1)
    return absl::InvalidArgumentError(absl::StrCat("latent attention: unsupported shape (heads ", shape.num_heads,
                                                   ", latent ", R, ", rope ", shape.rope_dim, ", slot ",
                                                   shape.cache_width, ", splits ", splits, ")"));
  const int head_tile = std::min(kHeadTile, shape.num_heads);
  const size_t bytes = static_cast<size_t>(LatentSmem(head_tile, R, W).floats) * sizeof(float);
  // Above the default 48 KiB a kernel must opt in (once per size; not a stream operation).
  static size_t opted_in = 48 << 10;
  if (bytes > opted_in) {
    const cudaError_t e = cudaFuncSetAttribute(LatentAttentionKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(bytes));
    if (e != cudaSuccess)
      return absl::InvalidArgumentError(absl::StrCat("latent attention: ", bytes, " bytes of shared memory for latent ",
                                                     R, " + rope ", shape.rope_dim, ": ", cudaGetErrorString(e)));
    opted_in = bytes;
  }
  const LatentSelection none;
  const dim3 grid((shape.num_heads + head_tile - 1) / head_tile, splits, T);
  LatentAttentionKernel<<<grid, kThreads, bytes, S(stream)>>>(
      q_latent, q, reinterpret_cast<const __half*>(cache_layer), tokens, selection != nullptr ? *selection : none,
      selection != nullptr, shape, head_tile, splits, split_positions, scratch, out_latent);
  EXL3_RETURN_IF_ERROR(LaunchStatus("latent attention"));
  if (splits == 1) return absl::OkStatus();
  LatentCombineKernel<<<dim3(shape.num_heads, T), 128, 0, S(stream)>>>(scratch, shape.num_heads, R, splits,
                                                                       out_latent);
  return LaunchStatus("latent attention combine");
}

}  // namespace exl3::engine::cuda
