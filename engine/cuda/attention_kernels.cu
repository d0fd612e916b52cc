#include "engine/cuda/attention_kernels.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cuda/launch_status.cuh"
#include "kernels/cuda/launch.cuh"

namespace exl3::engine::cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
// Warps per decode block sharing one token's query rows, each on its own share of the keys
// (heads of 64 and 128; heads of 256 take 2): DecodeAttentionSplits counts blocks of this many.
constexpr int kDecodeKeyWarps = 4;

// Opts a kernel into more than the default 48 KB of dynamic shared memory (once per kernel).
template <typename Kernel>
absl::Status AllowSharedMemory(Kernel kernel, size_t bytes, size_t* configured) {
  if (bytes <= 48 * 1024 || bytes <= *configured) return absl::OkStatus();
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)) !=
      cudaSuccess)
    return LaunchStatus("attention: shared memory limit");
  *configured = bytes;
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// The cache write.

// grid T, block 128. k, v [T, kv_floats] fp32; slot [T] int32; cache [slots, 2 * kv_floats] fp16.
__global__ void WriteKvKernel(const float* k, const float* v, const int32_t* slot, int kv_floats,
                              __half* cache) {
  exl3::cuda::PdlEnter();
  const int t = blockIdx.x;
  __half* dst = cache + static_cast<size_t>(slot[t]) * 2 * kv_floats;
  const float* kt = k + static_cast<size_t>(t) * kv_floats;
  const float* vt = v + static_cast<size_t>(t) * kv_floats;
  for (int j = threadIdx.x; j < kv_floats; j += blockDim.x) {
    dst[j] = __float2half_rn(kt[j]);
    dst[kv_floats + j] = __float2half_rn(vt[j]);
  }
}

// ---------------------------------------------------------------------------------------------
// The split partials' combination (both attention kernels write the same partials).

// grid (T, num_heads), block 128. scratch [T, num_heads, splits, head_dim + 2]: per split the
// score maximum in log2 units (-inf: the split saw nothing), the sum of 2^(score - max) and the
// unnormalised output. out [T, num_heads * head_dim] fp32.
// Dynamic shared memory [splits] floats: each split's weight exp2(m_s - M), computed once, so that
// every output value sums its splits with independent loads (the loop unrolled), in split order.
__global__ void CombineSplitsKernel(const float* scratch, int num_heads, int head_dim, int splits,
                                    float* out) {
  exl3::cuda::PdlEnter();
  extern __shared__ float split_weight[];
  const int t = blockIdx.x, head = blockIdx.y, D = head_dim;
  const float* part = scratch + (static_cast<size_t>(t) * num_heads + head) * splits * (D + 2);
  for (int s = threadIdx.x; s < splits; s += blockDim.x) split_weight[s] = part[s * (D + 2)];
  __syncthreads();
  float M = -INFINITY;
  for (int s = 0; s < splits; ++s) M = fmaxf(M, split_weight[s]);
  __syncthreads();  // every thread has read the maxima
  for (int s = threadIdx.x; s < splits; s += blockDim.x) {
    const float m = part[s * (D + 2)];
    split_weight[s] = m == -INFINITY ? 0.0f : exp2f(m - M);
  }
  __syncthreads();
  float L = 0.0f;
  for (int s = 0; s < splits; ++s) L += split_weight[s] * part[s * (D + 2) + 1];
  float* o = out + (static_cast<size_t>(t) * num_heads + head) * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float v = 0.0f;
#pragma unroll 8
    for (int s = 0; s < splits; ++s) v += split_weight[s] * part[s * (D + 2) + 2 + d];
    o[d] = L > 0.0f ? v / L : 0.0f;
  }
}

absl::Status CombineSplits(const float* scratch, int T, int num_heads, int head_dim, int splits, float* out,
                           StreamHandle stream) {
  if (splits * sizeof(float) > (48 << 10))
    return absl::InvalidArgumentError(absl::StrCat("attention: ", splits, " splits (at most 12288)"));
  // Rounded up to whole 32-byte groups: the unrolled loop may read a group of weights at once.
  const size_t weights_bytes = (splits + 7) / 8 * 8 * sizeof(float);
  exl3::cuda::LaunchPdlWithSmem(CombineSplitsKernel, dim3(T, num_heads), dim3(128), weights_bytes, S(stream), scratch,
                                num_heads, head_dim, splits, out);
  return LaunchStatus("attention: split combine");
}

// ---------------------------------------------------------------------------------------------
// Tensor-core attention (flash-attention 2 style: mma.sync m16n8k16 fp16 -> fp32, online
// softmax in registers), for decode and prefill alike.

__device__ inline unsigned SharedAddress(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronously; with `valid` false the destination is zero-filled
// and nothing is read.
__device__ inline void CopyAsync16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SharedAddress(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ inline void CopyAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int Pending>
__device__ inline void CopyAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending) : "memory");
}

// Four 8x8 fp16 matrices from shared memory (lane l gives the address of row l % 8 of matrix
// l / 8); r[i] holds matrix i's fragment (row lane / 4, columns 2 * (lane % 4) + {0, 1}).
__device__ inline void LoadMatrices(uint32_t (&r)[4], const __half* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SharedAddress(p))
               : "memory");
}
// The same, each matrix transposed.
__device__ inline void LoadMatricesTransposed(uint32_t (&r)[4], const __half* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SharedAddress(p))
               : "memory");
}

// c[16x8] += a[16x16] · b[16x8], fp16 inputs, fp32 accumulators.
__device__ inline void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ inline uint32_t PackHalves(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// How the tensor-core kernel's grid maps onto the query tokens: the T tokens form spans of
// `span_tokens` consecutive tokens of one sequence (1: every token its own; T: one prefill chunk);
// a span's rows (token-major, then the group's heads) are cut into tiles of 16 * warps rows.
struct TileShape {
  int num_heads, num_kv_heads, group;
  int span_tokens, tiles_per_span;
  int splits;
  const int32_t* split_positions;  // device memory; read when splits > 1
  float scale_log2;                // softmax scale × log2(e)
};

// Shared memory of one block: the query tile and, per key warp, `Stages` key and value tiles (a
// ring the loads run ahead in), rows padded by 16 bytes so the 8 rows an ldmatrix reads fall on
// distinct banks. After the key loop the rings hold the key warps' partials (KeyWarps > 1).
template <int D, int Warps, int KeyWarps, int KeyTile, int Stages>
constexpr size_t TensorCoreSharedBytes() {
  return static_cast<size_t>(16 * Warps + 2 * KeyWarps * Stages * KeyTile) * (D + 8) * sizeof(__half);
}

// grid (spans * tiles_per_span, num_kv_heads, splits), block 32 * Warps * KeyWarps; dynamic shared
// memory TensorCoreSharedBytes. q [T, num_heads * D] fp32 (token t's head h at (t * num_heads + h) * D);
// cache [slots, 2 * num_kv_heads * D] fp16 (keys of every KV head, then values); tok as
// AttentionTokens (a span's block table is its first token's). Block (x, g, s) takes rows
// [r0, r0 + 16 * Warps) of span x / tiles_per_span (r0 = (tiles_per_span - 1 - x % tiles_per_span)
// * 16 * Warps: a span's last tiles, which see the most keys, start first; row r is token r / group
// of the span and query head g * group + r % group), every warp 16 of them,
// over key positions [lo, hi): lo the least first_visible of the tile's tokens, hi one past their
// greatest position, split s of that range when splits > 1 (split_positions each, the last split
// to hi). Each row sees [first_visible, position] of its token. splits == 1: out [T, num_heads *
// D] fp32 written; else scratch [T, num_heads, splits, D + 2] (CombineSplitsKernel's partials).
// KeyWarps > 1 (decode: Warps == 1): that many warps share the 16 rows, key warp w taking the
// range's key tiles w, w + KeyWarps, ... through its own ring; their partials are merged in shared
// memory at the end. A block then has KeyWarps times the loads in flight and the prologue (the
// query tile, the rows' bounds) once for all of them: one warp per block waited on every step
// of its few tiles (ncu: one instruction issued per 6 cycles, 3 % occupancy at batch 1).
template <int D, int Warps, int KeyWarps, int KeyTile, int Stages>
__global__ void __launch_bounds__(32 * Warps * KeyWarps)
    TensorCoreAttentionKernel(const float* q, const __half* cache, AttentionTokens tok, TileShape a,
                              float* scratch, float* out) {
  exl3::cuda::PdlEnter();
  constexpr int M = 16 * Warps, STRIDE = D + 8;
  static_assert(D % 16 == 0 && KeyTile % 16 == 0 && Stages >= 2, "mma tiles, a load ahead");
  static_assert(KeyWarps == 1 || Warps == 1, "key warps share one warp's 16 rows");
  // The key warps' partials [KeyWarps][16][D + 1] fp32 (+ max and sum per row) fit in the rings.
  static_assert(KeyWarps == 1 || KeyWarps * 16 * (D + 3) * 4 <= 2 * KeyWarps * Stages * KeyTile * STRIDE * 2,
                "partials fit the rings");
  extern __shared__ __align__(16) unsigned char attention_smem[];
  __half* q_s = reinterpret_cast<__half*>(attention_smem);  // [M][STRIDE]
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int row_warp = warp % Warps, key_warp = warp / Warps;
  // This key warp's ring: [Stages][KeyTile][STRIDE] keys, then as many values.
  __half* k_s = q_s + M * STRIDE + key_warp * 2 * Stages * KeyTile * STRIDE;
  __half* v_s = k_s + Stages * KeyTile * STRIDE;
  __shared__ int row_first[M], row_last[M];
  __shared__ int key_lo, key_hi;

  const int G = a.group, g = blockIdx.y, s = blockIdx.z;
  const int span = blockIdx.x / a.tiles_per_span;
  const int row_begin = (a.tiles_per_span - 1 - static_cast<int>(blockIdx.x % a.tiles_per_span)) * M;
  const int token0 = span * a.span_tokens, span_rows = a.span_tokens * G;
  const int kv_floats = a.num_kv_heads * D, width = 2 * kv_floats, bs = tok.block_size;

  if (tid == 0) {
    key_lo = INT_MAX;
    key_hi = INT_MIN;
  }
  __syncthreads();
  if (tid < M) {
    const int r = row_begin + tid;
    if (r < span_rows) {
      const int t = token0 + r / G;
      row_first[tid] = tok.first_visible[t];
      row_last[tid] = tok.position[t];
      atomicMin(&key_lo, row_first[tid]);
      atomicMax(&key_hi, row_last[tid] + 1);
    } else {  // a padding row: sees nothing
      row_first[tid] = 1;
      row_last[tid] = 0;
    }
  }
  // The query tile in fp16 (padding rows zero).
  for (int i = tid; i < M * (D / 4); i += blockDim.x) {
    const int row = i / (D / 4), d = (i % (D / 4)) * 4, r = row_begin + row;
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (r < span_rows) {
      const int t = token0 + r / G, head = g * G + r % G;
      v = *reinterpret_cast<const float4*>(q + (static_cast<size_t>(t) * a.num_heads + head) * D + d);
    }
    __half2* dst = reinterpret_cast<__half2*>(q_s + row * STRIDE + d);
    dst[0] = __floats2half2_rn(v.x, v.y);
    dst[1] = __floats2half2_rn(v.z, v.w);
  }
  __syncthreads();

  int lo = key_lo, hi = key_hi;  // every tile has a real row, and each token sees itself: lo < hi
  if (a.splits > 1) {
    const int per = *a.split_positions;
    const int begin = lo + s * per;
    hi = s == a.splits - 1 ? hi : min(hi, begin + per);
    lo = begin;
  }
  const int num_tiles = hi > lo ? (hi - lo + KeyTile - 1) / KeyTile : 0;
  // This warp's tiles: every KeyWarps-th from key_warp (all of them with one key warp).
  const int my_tiles = num_tiles > key_warp ? (num_tiles - key_warp + KeyWarps - 1) / KeyWarps : 0;
  const int32_t* table = tok.tables + tok.table_offset[token0];
  // Who fills a ring: the whole block (one key warp), else the key warp's own lanes.
  const int loader = KeyWarps == 1 ? tid : lane, loaders = KeyWarps == 1 ? 32 * Warps : 32;
  auto ring_sync = [] {
    if constexpr (KeyWarps == 1) __syncthreads();
    else __syncwarp();
  };

  // Keys and values of positions [key0, key0 + KeyTile) of KV head g into a stage (zeros past hi),
  // asynchronously; the caller commits the group. `it`: the warp's own tile count.
  auto load_tile = [&](int it, int stage) {
    const int key0 = lo + (it * KeyWarps + key_warp) * KeyTile;
    __half* ks = k_s + stage * KeyTile * STRIDE;
    __half* vs = v_s + stage * KeyTile * STRIDE;
    for (int i = loader; i < KeyTile * (D / 8); i += loaders) {
      const int p = i / (D / 8), c = (i % (D / 8)) * 8, j = key0 + p;
      const bool valid = j < hi;
      const __half* src = cache;  // read nothing from it when not valid
      if (valid) {
        const size_t slot = static_cast<size_t>(table[j / bs]) * bs + j % bs;
        src = cache + slot * width + g * D + c;
      }
      CopyAsync16(ks + p * STRIDE + c, src, valid);
      CopyAsync16(vs + p * STRIDE + c, valid ? src + kv_floats : cache, valid);
    }
  };

  // This lane's two rows of the warp's 16: lane / 4 and lane / 4 + 8.
  const int my_row[2] = {row_warp * 16 + lane / 4, row_warp * 16 + lane / 4 + 8};
  const int first[2] = {row_first[my_row[0]], row_first[my_row[1]]};
  const int last[2] = {row_last[my_row[0]], row_last[my_row[1]]};
  float m[2] = {-INFINITY, -INFINITY};  // running maximum (log2 units)
  float l[2] = {0.0f, 0.0f};            // this lane's part of the running sum
  float o[D / 8][4];                    // output accumulators, 8 dims per entry
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;

  // Tiles 0 .. Stages - 2 in flight first; one commit group per tile (empty past the last), so
  // waiting for all but Stages - 2 groups waits for exactly tile `it`.
#pragma unroll
  for (int st = 0; st < Stages - 1; ++st) {
    if (st < my_tiles) load_tile(st, st);
    CopyAsyncCommit();
  }
  for (int it = 0; it < my_tiles; ++it) {
    CopyAsyncWait<Stages - 2>();
    ring_sync();  // tile `it` visible to the ring's readers; all of them done with tile it - 1
    {
      const int ahead = it + Stages - 1;  // into the stage tile it - 1 used
      if (ahead < my_tiles) load_tile(ahead, ahead % Stages);
      CopyAsyncCommit();
    }
    const int stage = it % Stages;
    const __half* ks = k_s + stage * KeyTile * STRIDE;
    const __half* vs = v_s + stage * KeyTile * STRIDE;

    // Scores of the warp's 16 rows against the tile's keys.
    float sc[KeyTile / 8][4];
#pragma unroll
    for (int i = 0; i < KeyTile / 8; ++i) sc[i][0] = sc[i][1] = sc[i][2] = sc[i][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D; kk += 16) {
      uint32_t qa[4];
      LoadMatrices(qa, q_s + (row_warp * 16 + lane % 16) * STRIDE + kk + (lane / 16) * 8);
#pragma unroll
      for (int nt = 0; nt < KeyTile / 8; nt += 2) {
        uint32_t kb[4];
        LoadMatrices(kb, ks + (nt * 8 + (lane / 16) * 8 + lane % 8) * STRIDE + kk + ((lane / 8) % 2) * 8);
        Mma(sc[nt], qa, kb[0], kb[1]);
        Mma(sc[nt + 1], qa, kb[2], kb[3]);
      }
    }
    // Scale, mask, online softmax.
    const int key0 = lo + (it * KeyWarps + key_warp) * KeyTile;
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int nt = 0; nt < KeyTile / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2, j = key0 + nt * 8 + (lane % 4) * 2 + e % 2;
        float v = sc[nt][e] * a.scale_log2;
        if (j < first[r] || j > last[r] || j >= hi) v = -INFINITY;
        sc[nt][e] = v;
        mx[r] = fmaxf(mx[r], v);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    }
    float ref[2], corr[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      ref[r] = mx[r] == -INFINITY ? 0.0f : mx[r];  // a row that has seen nothing stays at 0
      corr[r] = exp2f(m[r] - ref[r]);
      m[r] = mx[r];
      l[r] *= corr[r];
    }
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      o[i][0] *= corr[0];
      o[i][1] *= corr[0];
      o[i][2] *= corr[1];
      o[i][3] *= corr[1];
    }
#pragma unroll
    for (int nt = 0; nt < KeyTile / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float p = exp2f(sc[nt][e] - ref[e / 2]);
        sc[nt][e] = p;
        l[e / 2] += p;
      }
    }
    // o += P · V: the score accumulators are the A fragments of P (fp16).
#pragma unroll
    for (int kk = 0; kk < KeyTile / 16; ++kk) {
      const uint32_t pa[4] = {PackHalves(sc[2 * kk][0], sc[2 * kk][1]), PackHalves(sc[2 * kk][2], sc[2 * kk][3]),
                              PackHalves(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                              PackHalves(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
      for (int dt = 0; dt < D / 8; dt += 2) {
        uint32_t vb[4];
        LoadMatricesTransposed(vb, vs + (kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * STRIDE + dt * 8 + (lane / 16) * 8);
        Mma(o[dt], pa, vb[0], vb[1]);
        Mma(o[dt + 1], pa, vb[2], vb[3]);
      }
    }
  }
  CopyAsyncWait<0>();  // nothing left in flight into shared memory at exit (empty groups only)

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
  if constexpr (KeyWarps > 1) {
    // Merge the key warps' partials: each writes its rows' (max, sum, output) into the rings'
    // space, then the block combines them as CombineSplitsKernel combines splits.
    __syncthreads();  // every warp is past its last tile: the rings are free
    float* part = reinterpret_cast<float*>(q_s + M * STRIDE);  // [KeyWarps][16][D + 3]
    constexpr int PS = D + 3;
    float* mine = part + key_warp * 16 * PS;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float* row = mine + (lane / 4 + 8 * r) * PS;
      if (lane % 4 == 0) {
        row[D] = m[r];
        row[D + 1] = l[r];
      }
#pragma unroll
      for (int i = 0; i < D / 8; ++i) {
        row[i * 8 + (lane % 4) * 2] = o[i][2 * r];
        row[i * 8 + (lane % 4) * 2 + 1] = o[i][2 * r + 1];
      }
    }
    __syncthreads();
    for (int idx = tid; idx < 16 * D; idx += blockDim.x) {
      const int r = idx / D, d = idx % D, row = row_begin + r;
      if (row >= span_rows) continue;
      float M_ = -INFINITY;
#pragma unroll
      for (int w = 0; w < KeyWarps; ++w) M_ = fmaxf(M_, part[(w * 16 + r) * PS + D]);
      float L = 0.0f, O = 0.0f;
      if (M_ != -INFINITY) {
#pragma unroll
        for (int w = 0; w < KeyWarps; ++w) {
          const float* pw = part + (w * 16 + r) * PS;
          if (pw[D] == -INFINITY) continue;
          const float f = exp2f(pw[D] - M_);
          L += f * pw[D + 1];
          O += f * pw[d];
        }
      }
      const int t = token0 + row / G, head = g * G + row % G;
      const size_t out_row = static_cast<size_t>(t) * a.num_heads + head;
      if (a.splits == 1) {
        out[out_row * D + d] = L > 0.0f ? O / L : 0.0f;
      } else {
        float* dst = scratch + (out_row * a.splits + s) * (D + 2);
        if (d == 0) {
          dst[0] = M_;
          dst[1] = L;
        }
        dst[2 + d] = O;
      }
    }
  } else {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row_begin + my_row[r];
      if (row >= span_rows) continue;
      const int t = token0 + row / G, head = g * G + row % G;
      const size_t out_row = static_cast<size_t>(t) * a.num_heads + head;
      const int d0 = (lane % 4) * 2;
      if (a.splits == 1) {
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        float* dst = out + out_row * D;
#pragma unroll
        for (int i = 0; i < D / 8; ++i)
          *reinterpret_cast<float2*>(dst + i * 8 + d0) = make_float2(o[i][2 * r] * inv, o[i][2 * r + 1] * inv);
      } else {
        float* dst = scratch + (out_row * a.splits + s) * (D + 2);
        if (lane % 4 == 0) {
          dst[0] = m[r];
          dst[1] = l[r];
        }
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
          dst[2 + i * 8 + d0] = o[i][2 * r];
          dst[2 + i * 8 + d0 + 1] = o[i][2 * r + 1];
        }
      }
    }
  }
}

template <int D, int Warps, int KeyWarps, int KeyTile, int Stages>
absl::Status LaunchTensorCore(const float* q, const __half* cache, const AttentionTokens& tok, TileShape a,
                              int num_spans, float* scratch, float* out, StreamHandle stream) {
  constexpr int M = 16 * Warps;
  constexpr size_t smem = TensorCoreSharedBytes<D, Warps, KeyWarps, KeyTile, Stages>();
  static size_t configured = 0;
  EXL3_RETURN_IF_ERROR(
      AllowSharedMemory(TensorCoreAttentionKernel<D, Warps, KeyWarps, KeyTile, Stages>, smem, &configured));
  a.tiles_per_span = (a.span_tokens * a.group + M - 1) / M;
  const dim3 grid(num_spans * a.tiles_per_span, a.num_kv_heads, a.splits);
  exl3::cuda::LaunchPdlWithSmem(TensorCoreAttentionKernel<D, Warps, KeyWarps, KeyTile, Stages>, dim3(grid),
                                dim3(32 * Warps * KeyWarps), smem, S(stream), q, cache, tok, a, scratch, out);
  return LaunchStatus("attention (tensor cores)");
}

// Decode blocks take one token's group (16 rows) with kDecodeKeyWarps warps over its keys, each
// with key tiles of 16 in its own ring of 3 (2 tiles in flight per warp; 106 KB for heads of 128,
// two blocks per SM; heads of 256: 2 key warps, a ring of 2). Groups over 16 heads and prefill
// tiles take 64 rows (4 warps) with key tiles of 64 in a ring of 2 (16 for heads of 256, whose
// accumulators need the registers).
enum class TileKind { kDecode, kWide };

template <int D>
absl::Status LaunchForHeadDim(TileKind kind, const float* q, const __half* cache, const AttentionTokens& tok,
                              const TileShape& a, int num_spans, float* scratch, float* out,
                              StreamHandle stream) {
  constexpr int kDecodeStages = D == 256 ? 2 : 3, kDecodeWarps = D == 256 ? 2 : kDecodeKeyWarps;
  constexpr int kWideKeys = D == 256 ? 16 : 64;
  if (kind == TileKind::kDecode)
    return LaunchTensorCore<D, 1, kDecodeWarps, 16, kDecodeStages>(q, cache, tok, a, num_spans, scratch, out, stream);
  return LaunchTensorCore<D, 4, 1, kWideKeys, 2>(q, cache, tok, a, num_spans, scratch, out, stream);
}

absl::Status LaunchTensorCoreAttention(TileKind kind, const float* q, const __half* cache,
                                       const AttentionTokens& tok, const TileShape& a, int head_dim, int num_spans,
                                       float* scratch, float* out, StreamHandle stream) {
  switch (head_dim) {
    case 64: return LaunchForHeadDim<64>(kind, q, cache, tok, a, num_spans, scratch, out, stream);
    case 128: return LaunchForHeadDim<128>(kind, q, cache, tok, a, num_spans, scratch, out, stream);
    case 256: return LaunchForHeadDim<256>(kind, q, cache, tok, a, num_spans, scratch, out, stream);
    default: return absl::InvalidArgumentError(absl::StrCat("tensor-core attention: head_dim ", head_dim));
  }
}

// ---------------------------------------------------------------------------------------------
// CUDA-core decode attention: the fallback for head dims the tensor-core kernel does not take.

constexpr int kFallbackThreads = 128;

struct FallbackShape {
  int num_heads, num_kv_heads, head_dim, group, splits;
  const int32_t* split_positions;  // device memory
  int tile;
  float scale;
};

// Floats of shared memory one block uses (rows padded to head_dim + 1 against bank conflicts).
__host__ __device__ inline int FallbackSharedFloats(const FallbackShape& a) {
  const int row = a.head_dim + 1;
  return a.group * a.head_dim       // q of the group (scaled)
         + 2 * a.tile * row          // K and V of the tile
         + a.group * a.tile          // scores, then probabilities
         + a.group * a.head_dim      // running output
         + 3 * a.group;              // running max, sum, correction
}

// grid (T, num_kv_heads, splits), block kFallbackThreads. Block (t, g, s) runs the query heads of
// KV head g for token t over positions [first + s * SP, first + (s + 1) * SP) ∩ [first, pos] (the
// last split to pos) and writes, per head, CombineSplitsKernel's partial (max in log2 units, sum,
// unnormalised output [head_dim]) to scratch [T, num_heads, splits, head_dim + 2]. q [T,
// num_heads * head_dim] fp32; cache [slots, 2 * num_kv_heads * head_dim] fp16.
__global__ void FallbackPartialKernel(const float* q, const __half* cache, AttentionTokens tok, FallbackShape a,
                                      float* scratch) {
  exl3::cuda::PdlEnter();
  extern __shared__ float smem[];
  const int t = blockIdx.x, g = blockIdx.y, s = blockIdx.z;
  const int D = a.head_dim, G = a.group, row = D + 1, P = a.tile;
  const int kv_floats = a.num_kv_heads * D, width = 2 * kv_floats;
  float* q_s = smem;
  float* k_s = q_s + G * D;
  float* v_s = k_s + P * row;
  float* p_s = v_s + P * row;
  float* acc = p_s + G * P;
  float* m_s = acc + G * D;
  float* l_s = m_s + G;
  float* c_s = l_s + G;

  const int pos = tok.position[t], first = tok.first_visible[t];
  const int per = a.splits > 1 ? *a.split_positions : pos - first + 1;
  const int begin = first + s * per;
  const int end = s == a.splits - 1 ? pos + 1 : min(pos + 1, begin + per);
  const float* qt = q + (static_cast<size_t>(t) * a.num_heads + g * G) * D;
  for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
    q_s[i] = qt[i] * a.scale;
    acc[i] = 0.0f;
  }
  for (int h = threadIdx.x; h < G; h += blockDim.x) {
    m_s[h] = -INFINITY;
    l_s[h] = 0.0f;
  }
  const int32_t* table = tok.tables + tok.table_offset[t];
  for (int j0 = begin; j0 < end; j0 += P) {
    const int n = min(P, end - j0);
    __syncthreads();  // the previous tile's readers are done
    for (int item = threadIdx.x; item < n * (D / 4); item += blockDim.x) {
      const int p = item / (D / 4), d = (item % (D / 4)) * 4;
      const int j = j0 + p;
      const size_t slot = static_cast<size_t>(table[j / tok.block_size]) * tok.block_size + j % tok.block_size;
      const __half2* kp = reinterpret_cast<const __half2*>(cache + slot * width + g * D + d);
      const __half2* vp = reinterpret_cast<const __half2*>(cache + slot * width + kv_floats + g * D + d);
      const float2 k01 = __half22float2(kp[0]), k23 = __half22float2(kp[1]);
      const float2 v01 = __half22float2(vp[0]), v23 = __half22float2(vp[1]);
      float* kr = k_s + p * row + d;
      float* vr = v_s + p * row + d;
      kr[0] = k01.x, kr[1] = k01.y, kr[2] = k23.x, kr[3] = k23.y;
      vr[0] = v01.x, vr[1] = v01.y, vr[2] = v23.x, vr[3] = v23.y;
    }
    __syncthreads();
    for (int item = threadIdx.x; item < G * n; item += blockDim.x) {
      const int h = item / n, p = item % n;
      const float* qh = q_s + h * D;
      const float* kr = k_s + p * row;
      float dot = 0.0f;
      for (int d = 0; d < D; ++d) dot += qh[d] * kr[d];
      p_s[h * P + p] = dot;
    }
    __syncthreads();
    for (int h = threadIdx.x; h < G; h += blockDim.x) {
      float mx = m_s[h];
      for (int p = 0; p < n; ++p) mx = fmaxf(mx, p_s[h * P + p]);
      const float corr = m_s[h] == -INFINITY ? 0.0f : expf(m_s[h] - mx);
      float sum = 0.0f;
      for (int p = 0; p < n; ++p) {
        const float e = expf(p_s[h * P + p] - mx);
        p_s[h * P + p] = e;
        sum += e;
      }
      l_s[h] = l_s[h] * corr + sum;
      m_s[h] = mx;
      c_s[h] = corr;
    }
    __syncthreads();
    for (int item = threadIdx.x; item < G * D; item += blockDim.x) {
      const int h = item / D, d = item % D;
      float o = acc[item] * c_s[h];
      for (int p = 0; p < n; ++p) o += p_s[h * P + p] * v_s[p * row + d];
      acc[item] = o;
    }
  }
  __syncthreads();
  for (int item = threadIdx.x; item < G * (D + 2); item += blockDim.x) {
    const int h = item / (D + 2), i = item % (D + 2);
    const int head = g * G + h;
    float* dst = scratch + ((static_cast<size_t>(t) * a.num_heads + head) * a.splits + s) * (D + 2);
    // The combine works in log2 units: 2^(m log2 e) = e^m.
    dst[i] = i == 0 ? (m_s[h] == -INFINITY ? -INFINITY : m_s[h] * kLog2e) : i == 1 ? l_s[h] : acc[h * D + i - 2];
  }
}

absl::Status FallbackAttention(const float* q, const __half* cache, const AttentionTokens& tok, int T,
                               int num_heads, int num_kv_heads, int head_dim, float scale, int splits,
                               const int32_t* split_positions, float* scratch, float* out, StreamHandle stream) {
  FallbackShape a{num_heads, num_kv_heads, head_dim, num_heads / num_kv_heads, splits, split_positions, 32, scale};
  // The largest tile whose block fits the shared memory every Hopper/Ampere part offers (99 KB).
  while (a.tile > 4 && FallbackSharedFloats(a) * sizeof(float) > 99 * 1024) a.tile /= 2;
  const size_t smem = FallbackSharedFloats(a) * sizeof(float);
  if (smem > 99 * 1024)
    return absl::InvalidArgumentError(absl::StrCat("paged attention: a group of ", a.group, " heads of ", head_dim,
                                                   " needs too much shared memory"));
  static size_t configured = 0;
  EXL3_RETURN_IF_ERROR(AllowSharedMemory(FallbackPartialKernel, 99 * 1024, &configured));
  exl3::cuda::LaunchPdlWithSmem(FallbackPartialKernel, dim3(T, num_kv_heads, splits), dim3(kFallbackThreads), smem,
                                S(stream), q, cache, tok, a, scratch);
  EXL3_RETURN_IF_ERROR(LaunchStatus("paged attention (CUDA cores)"));
  return CombineSplits(scratch, T, num_heads, head_dim, splits, out, stream);
}

absl::Status CheckShape(const char* what, int num_heads, int num_kv_heads, int head_dim, int splits,
                        const int32_t* split_positions, const float* scratch) {
  if (head_dim % 4 != 0 || head_dim > 256 || head_dim <= 0 || num_kv_heads <= 0 || num_heads % num_kv_heads != 0 ||
      splits < 1 || (splits > 1 && (split_positions == nullptr || scratch == nullptr)))
    return absl::InvalidArgumentError(absl::StrCat(what, ": unsupported shape: ", num_heads, " heads, ", num_kv_heads,
                                                   " KV heads of ", head_dim, ", ", splits, " splits"));
  return absl::OkStatus();
}

}  // namespace

absl::Status WriteKv(const float* k, const float* v, const int32_t* slot, int T, int kv_floats, KvHalf* cache_layer,
                     StreamHandle stream) {
  if (T == 0) return absl::OkStatus();
  exl3::cuda::LaunchPdlWithSmem(WriteKvKernel, dim3(T), dim3(128), 0, S(stream), k, v, slot, kv_floats,
                                reinterpret_cast<__half*>(cache_layer));
  return LaunchStatus("kv cache write");
}

int64_t AttentionScratchFloats(int T, int num_heads, int head_dim, int splits) {
  return static_cast<int64_t>(T) * num_heads * splits * (head_dim + 2);
}

int DecodeAttentionSplits(int num_tokens, int num_kv_heads, int sm_count) {
  const int blocks = std::max(1, num_tokens * num_kv_heads);
  if (2 * blocks <= sm_count) return std::clamp((3 * sm_count + 2 * blocks - 1) / (2 * blocks), 1, 32);
  return 1;
}

bool PrefillAttentionSupports(int head_dim) { return head_dim == 64 || head_dim == 128 || head_dim == 256; }

absl::Status PagedAttention(const float* q, const KvHalf* cache_layer, const AttentionTokens& tokens, int T,
                            int num_heads, int num_kv_heads, int head_dim, float scale, int splits,
                            const int32_t* split_positions, float* scratch, float* out, StreamHandle stream) {
  if (T == 0) return absl::OkStatus();
  EXL3_RETURN_IF_ERROR(CheckShape("paged attention", num_heads, num_kv_heads, head_dim, splits, split_positions, scratch));
  const __half* cache = reinterpret_cast<const __half*>(cache_layer);
  if (!PrefillAttentionSupports(head_dim))
    return FallbackAttention(q, cache, tokens, T, num_heads, num_kv_heads, head_dim, scale, splits, split_positions,
                             scratch, out, stream);
  const int group = num_heads / num_kv_heads;
  TileShape a{num_heads, num_kv_heads, group, /*span_tokens=*/1, 0, splits, split_positions, scale * kLog2e};
  EXL3_RETURN_IF_ERROR(LaunchTensorCoreAttention(group <= 16 ? TileKind::kDecode : TileKind::kWide, q, cache, tokens,
                                                 a, head_dim, /*num_spans=*/T, scratch, out, stream));
  if (splits == 1) return absl::OkStatus();
  return CombineSplits(scratch, T, num_heads, head_dim, splits, out, stream);
}

absl::Status PrefillAttention(const float* q, const KvHalf* cache_layer, const AttentionTokens& tokens, int T,
                              int num_heads, int num_kv_heads, int head_dim, float scale, int splits,
                              const int32_t* split_positions, float* scratch, float* out, StreamHandle stream) {
  if (T == 0) return absl::OkStatus();
  EXL3_RETURN_IF_ERROR(CheckShape("prefill attention", num_heads, num_kv_heads, head_dim, splits, split_positions, scratch));
  if (!PrefillAttentionSupports(head_dim))
    return absl::InvalidArgumentError(absl::StrCat("prefill attention: head_dim ", head_dim,
                                                   " (64, 128 or 256; PagedAttention takes the others)"));
  const __half* cache = reinterpret_cast<const __half*>(cache_layer);
  TileShape a{num_heads, num_kv_heads, num_heads / num_kv_heads, /*span_tokens=*/T, 0, splits, split_positions,
              scale * kLog2e};
  EXL3_RETURN_IF_ERROR(LaunchTensorCoreAttention(TileKind::kWide, q, cache, tokens, a, head_dim, /*num_spans=*/1,
                                                 scratch, out, stream));
  if (splits == 1) return absl::OkStatus();
  return CombineSplits(scratch, T, num_heads, head_dim, splits, out, stream);
}

}  // namespace exl3::engine::cuda
