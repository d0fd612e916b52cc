#include "engine/cuda/latent_attention_kernels.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "engine/cuda/launch_status.cuh"
#include "engine/cuda/block_reduce.cuh"
#include "kernels/cuda/launch.cuh"

namespace exl3::engine::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kHeadTile = 16;     // query heads per block (each cached position read once for them)
constexpr int kPositionTile = 16;  // cached positions staged in shared memory at a time

__global__ void WriteLatentKernel(const float* ckv, const float* w, int R, int rope, float eps,
                                  const int32_t* slot, __half* cache, int width) {
  exl3::cuda::PdlEnter();
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

// The positions token t attends to (the indexer's chosen ones, or every visible one) and the part
// [begin, end) of them that split `split` of `splits` takes; Slot(i): the cache slot of the i-th.
struct SplitPositions {
  const int32_t* list;  // chosen positions, or null: first_visible .. position
  const int32_t* table;
  int first, block_size, begin, end;
  __device__ SplitPositions(const AttentionTokens& at, const LatentSelection& sel, bool selected, int t, int split,
                            int splits, const int32_t* split_positions)
      : list(selected ? sel.positions + static_cast<size_t>(t) * sel.stride : nullptr),
        table(at.tables + at.table_offset[t]),
        first(at.first_visible[t]),
        block_size(at.block_size) {
    const int n = selected ? sel.count[t] : at.position[t] - first + 1;
    const int per = *split_positions;
    begin = split * per;
    end = split == splits - 1 ? n : min(n, begin + per);
  }
  __device__ int Slot(int i) const {
    const int p = list != nullptr ? list[i] : first + i;
    return table[p / block_size] * block_size + p % block_size;
  }
};

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
  exl3::cuda::PdlEnter();
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

  const SplitPositions span(at, sel, selected, t, split, splits, split_positions);
  const int i0 = span.begin, i1 = span.end;

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
      slots[threadIdx.x] = span.Slot(base + threadIdx.x);
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

// ---------------------------------------------------------------------------------------------
// The tensor-core cut: the same blocks (one token, 16 heads as the 16 rows of the products, one
// split), positions staged 32 at a time; scores S[16, 32] = Q[16, W] · K[32, W]ᵀ (the K dimension
// split over four warp pairs, their partials summed), the online softmax in fp32 on 16 threads,
// then O[16, R] += P[16, 32] · latent[32, R] with O kept in shared memory (the accumulator
// fragments' layout is opaque: each row's rescale is applied to O there, before the product).

namespace wmma = nvcuda::wmma;

constexpr int kTcRows = 16;       // query heads per block: the products' M
constexpr int kTcPositions = 32;  // positions per tile
constexpr int kTcPad = 8;         // halves of padding per row of the fp16 tiles (bank spread; keeps 16-byte rows)
static_assert(kThreads == kTcRows * 16 && kTcPositions == 32, "the softmax takes 16 threads per row, 2 positions each");

// Shared memory of one tensor-core block, in bytes from a 128-byte aligned base.
struct LatentTcSmem {
  int q, kv, part, probs, out, stats, slots, bytes;
  int q_ld, kv_ld, probs_ld, out_ld;
  __host__ __device__ static int Align(int b) { return (b + 127) / 128 * 128; }
  __host__ __device__ LatentTcSmem(int R, int W) {
    q_ld = W + kTcPad;
    kv_ld = W + kTcPad;
    probs_ld = kTcPositions + kTcPad;
    out_ld = R + 4;
    q = 0;
    kv = Align(q + kTcRows * q_ld * 2);
    part = Align(kv + kTcPositions * kv_ld * 2);                 // float [4][16][32]
    probs = Align(part + 4 * kTcRows * kTcPositions * 4);        // half [16][probs_ld]
    out = Align(probs + kTcRows * probs_ld * 2);                 // float [16][out_ld]
    stats = Align(out + kTcRows * out_ld * 4);                   // float [3][16]
    slots = Align(stats + 3 * kTcRows * 4);                      // int [32]
    bytes = Align(slots + kTcPositions * 4);
  }
};

__global__ void LatentAttentionTcKernel(const float* q_latent, const float* q, const __half* cache,
                                        AttentionTokens at, LatentSelection sel, bool selected,
                                        LatentAttentionShape shape, int splits, const int32_t* split_positions,
                                        float* scratch, float* out) {
  exl3::cuda::PdlEnter();
  extern __shared__ __align__(128) unsigned char tc_smem[];
  const int R = shape.latent_dim, W = R + shape.rope_dim, NH = shape.num_heads;
  const int t = blockIdx.z, split = blockIdx.y, h0 = blockIdx.x * kTcRows;
  const int nh = min(kTcRows, NH - h0);
  const LatentTcSmem lay(R, W);
  __half* qs = reinterpret_cast<__half*>(tc_smem + lay.q);
  __half* kv = reinterpret_cast<__half*>(tc_smem + lay.kv);
  float* part = reinterpret_cast<float*>(tc_smem + lay.part);
  __half* probs = reinterpret_cast<__half*>(tc_smem + lay.probs);
  float* acc = reinterpret_cast<float*>(tc_smem + lay.out);
  float* run_max = reinterpret_cast<float*>(tc_smem + lay.stats);
  float* run_sum = run_max + kTcRows;
  float* rescale = run_sum + kTcRows;
  int* slots = reinterpret_cast<int*>(tc_smem + lay.slots);

  const SplitPositions span(at, sel, selected, t, split, splits, split_positions);
  const int i0 = span.begin, i1 = span.end;

  // Queries as fp16 rows (rows past the last head zero), O zero, the running max and sum. The
  // per-row loops give warp w rows w, w + 8 and its lanes the columns: a decode step's block does
  // little else, and index arithmetic by a runtime width would cost more than the work.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = kThreads / 32;
  for (int hh = warp; hh < kTcRows; hh += warps) {
    const size_t head = static_cast<size_t>(t) * NH + h0 + hh;
    for (int d = lane; d < W; d += 32) {
      float v = 0.0f;
      if (hh < nh) v = d < R ? q_latent[head * R + d] : q[head * shape.q_stride + shape.rope_offset + (d - R)];
      qs[hh * lay.q_ld + d] = __float2half_rn(v);
    }
    for (int r = lane; r < R; r += 32) acc[hh * lay.out_ld + r] = 0.0f;
  }
  if (threadIdx.x < kTcRows) {
    run_max[threadIdx.x] = -INFINITY;
    run_sum[threadIdx.x] = 0.0f;
  }
  const int k_chunks = W / 16, out_frags = R / 16;
  for (int base = i0; base < i1; base += kTcPositions) {
    const int np = min(kTcPositions, i1 - base);
    __syncthreads();  // the previous tile's kv, probabilities and O products are done
    if (threadIdx.x < kTcPositions) {
      int slot = -1;
      if (threadIdx.x < np) {
        slot = span.Slot(base + threadIdx.x);
      }
      slots[threadIdx.x] = slot;
    }
    __syncthreads();
    // The tile's slots, 16 bytes at a time (rows past np zero: they meet probability 0).
    const int vecs = W / 8;
    for (int pp = warp; pp < kTcPositions; pp += warps) {
      const int slot = slots[pp];
      for (int v = lane; v < vecs; v += 32) {
        uint4 x = make_uint4(0, 0, 0, 0);
        if (slot >= 0) x = *reinterpret_cast<const uint4*>(cache + static_cast<size_t>(slot) * shape.cache_width + v * 8);
        *reinterpret_cast<uint4*>(kv + pp * lay.kv_ld + v * 8) = x;
      }
    }
    __syncthreads();
    {  // scores: warp w takes position fragment w % 2 over the K chunks w / 2, w / 2 + 4, ...
      const int frag = warp % 2, k0 = warp / 2;
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
      wmma::fill_fragment(c, 0.0f);
      for (int kc = k0; kc < k_chunks; kc += 4) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b;
        wmma::load_matrix_sync(a, qs + kc * 16, lay.q_ld);
        wmma::load_matrix_sync(b, kv + frag * 16 * lay.kv_ld + kc * 16, lay.kv_ld);
        wmma::mma_sync(c, a, b, c);
      }
      wmma::store_matrix_sync(part + k0 * kTcRows * kTcPositions + frag * 16, c, kTcPositions, wmma::mem_row_major);
    }
    __syncthreads();
    {  // online softmax: 16 threads per row (kThreads = 16 rows x 16), two positions each
      const int r = threadIdx.x / 16, c = threadIdx.x % 16;
      auto score = [&](int pp) {
        float v = 0.0f;
        for (int g = 0; g < 4; ++g) v += part[g * kTcRows * kTcPositions + r * kTcPositions + pp];
        return v * shape.scale;
      };
      const float s0 = c < np ? score(c) : -INFINITY, s1 = c + 16 < np ? score(c + 16) : -INFINITY;
      const float old_max = run_max[r];
      float m = fmaxf(old_max, fmaxf(s0, s1));
      for (int o = 8; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));  // within the 16 lanes
      // m is finite: the row's first lane holds a real position's score (np ≥ 1).
      const __half p0 = __float2half_rn(c < np ? expf(s0 - m) : 0.0f);
      const __half p1 = __float2half_rn(c + 16 < np ? expf(s1 - m) : 0.0f);
      probs[r * lay.probs_ld + c] = p0;
      probs[r * lay.probs_ld + c + 16] = p1;
      float sum = __half2float(p0) + __half2float(p1);
      for (int o = 8; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      __syncwarp();  // every lane of the row has read run_max
      if (c == 0) {
        const float rs = old_max == -INFINITY ? 0.0f : expf(old_max - m);
        run_max[r] = m;
        run_sum[r] = run_sum[r] * rs + sum;
        rescale[r] = rs;
      }
    }
    __syncthreads();
    for (int hh = warp; hh < kTcRows; hh += warps) {
      const float rs = rescale[hh];
      if (rs == 1.0f) continue;  // the row's max did not move (x * 1 is x)
      for (int r = lane; r < R; r += 32) acc[hh * lay.out_ld + r] *= rs;
    }
    __syncthreads();
    for (int f = warp; f < out_frags; f += warps) {  // O[:, 16 f ..] += P · latent[:, 16 f ..]
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
      wmma::load_matrix_sync(c, acc + f * 16, lay.out_ld, wmma::mem_row_major);
      for (int kc = 0; kc < kTcPositions / 16; ++kc) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> b;
        wmma::load_matrix_sync(a, probs + kc * 16, lay.probs_ld);
        wmma::load_matrix_sync(b, kv + kc * 16 * lay.kv_ld + f * 16, lay.kv_ld);
        wmma::mma_sync(c, a, b, c);
      }
      wmma::store_matrix_sync(acc + f * 16, c, lay.out_ld, wmma::mem_row_major);
    }
  }
  __syncthreads();
  for (int hh = warp; hh < nh; hh += warps) {
    const size_t head = static_cast<size_t>(t) * NH + h0 + hh;
    const float* a = acc + hh * lay.out_ld;
    if (splits == 1) {
      const float l = run_sum[hh];
      for (int r = lane; r < R; r += 32) out[head * R + r] = l > 0.0f ? a[r] / l : 0.0f;
    } else {
      float* p = scratch + (head * splits + split) * (R + 2);
      for (int r = lane; r < R; r += 32) p[r] = a[r];
      if (lane == 0) {
        p[R] = run_max[hh];
        p[R + 1] = run_sum[hh];
      }
    }
  }
}

// out[t, h] from the splits' partials (max, sum, unnormalised output); grid (heads, T), dynamic
// shared memory [splits] floats. Each split's weight exp(max_s - max) is computed once; then every
// output value sums its splits with independent loads (the splits' loop unrolled), the same sums
// in the same order as one thread per value would make.
__global__ void LatentCombineKernel(const float* scratch, int NH, int R, int splits, float* out) {
  exl3::cuda::PdlEnter();
  extern __shared__ float split_weight[];
  const size_t head = static_cast<size_t>(blockIdx.y) * NH + blockIdx.x;
  const float* part = scratch + head * splits * (R + 2);
  for (int s = threadIdx.x; s < splits; s += blockDim.x) split_weight[s] = part[s * (R + 2) + R];
  __syncthreads();
  float m = -INFINITY;
  for (int s = 0; s < splits; ++s) m = fmaxf(m, split_weight[s]);
  __syncthreads();  // every thread has read the maxima
  for (int s = threadIdx.x; s < splits; s += blockDim.x) {
    const float ms = part[s * (R + 2) + R];
    split_weight[s] = ms == -INFINITY ? 0.0f : expf(ms - m);
  }
  __syncthreads();
  float l = 0.0f;
  for (int s = 0; s < splits; ++s) l += split_weight[s] * part[s * (R + 2) + R + 1];
  for (int r = threadIdx.x; r < R; r += blockDim.x) {
    float o = 0.0f;
#pragma unroll 8
    for (int s = 0; s < splits; ++s) o += split_weight[s] * part[s * (R + 2) + r];
    out[head * R + r] = l > 0.0f ? o / l : 0.0f;
  }
}

}  // namespace

absl::Status WriteLatentToCache(const float* ckv, const float* w, int T, int R, int rope, float eps,
                                const int32_t* slot, KvHalf* cache_layer, int width, StreamHandle stream) {
  if (T == 0) return absl::OkStatus();
  if (R + rope > width) return absl::InvalidArgumentError("latent cache write: slot narrower than latent + rope key");
  exl3::cuda::LaunchPdlWithSmem(WriteLatentKernel, dim3(T), dim3(kThreads), 0, S(stream), ckv, w, R, rope, eps, slot,
                                reinterpret_cast<__half*>(cache_layer), width);
  return LaunchStatus("latent cache write");
}

int LatentAttentionHeadTiles(int num_heads) { return (num_heads + kHeadTile - 1) / kHeadTile; }

bool LatentTensorCoresSupport(const LatentAttentionShape& shape) {
  return shape.latent_dim > 0 && shape.latent_dim % 16 == 0 && shape.rope_dim % 16 == 0 &&
         shape.cache_width % 8 == 0 && LatentTcSmem(shape.latent_dim, shape.latent_dim + shape.rope_dim).bytes <= (227 << 10);
}

int64_t LatentAttentionScratchFloats(int T, int NH, int R, int splits) {
  return splits > 1 ? static_cast<int64_t>(T) * NH * splits * (R + 2) : 0;
}

absl::Status LatentAttention(const float* q_latent, const float* q, const KvHalf* cache_layer,
                             const AttentionTokens& tokens, const LatentSelection* selection, int T,
                             const LatentAttentionShape& shape, int splits, const int32_t* split_positions,
                             float* scratch, float* out_latent, StreamHandle stream, LatentKernel kernel) {
  if (T == 0) return absl::OkStatus();
  if (T > 65535) return absl::InvalidArgumentError(absl::StrCat("latent attention: ", T, " tokens in one step (at most 65535)"));
  const int R = shape.latent_dim, W = R + shape.rope_dim;
  if (R <= 0 || shape.rope_dim < 0 || W > shape.cache_width || shape.num_heads <= 0 || splits < 1)
    return absl::InvalidArgumentError(absl::StrCat("latent attention: unsupported shape (heads ", shape.num_heads,
                                                   ", latent ", R, ", rope ", shape.rope_dim, ", slot ",
                                                   shape.cache_width, ", splits ", splits, ")"));
  const LatentSelection none;
  const LatentSelection& sel = selection != nullptr ? *selection : none;
  const __half* cache = reinterpret_cast<const __half*>(cache_layer);
  // Above the default 48 KiB a kernel must opt in (once per size; not a stream operation, so
  // the eager step before a graph capture does it).
  auto opt_in = [&](const void* fn, size_t bytes, size_t* opted_in) -> absl::Status {
    if (bytes <= *opted_in) return absl::OkStatus();
    const cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
    if (e != cudaSuccess)
      return absl::InvalidArgumentError(absl::StrCat("latent attention: ", bytes, " bytes of shared memory for latent ",
                                                     R, " + rope ", shape.rope_dim, ": ", cudaGetErrorString(e)));
    *opted_in = bytes;
    return absl::OkStatus();
  };
  if (kernel == LatentKernel::kTensorCores) {
    if (!LatentTensorCoresSupport(shape))
      return absl::InvalidArgumentError(absl::StrCat("latent attention on tensor cores: latent ", R, " and rope ",
                                                     shape.rope_dim, " must be multiples of 16, the slot (",
                                                     shape.cache_width, ") of 8"));
    const size_t bytes = LatentTcSmem(R, W).bytes;
    static size_t tc_opted_in = 48 << 10;
    EXL3_RETURN_IF_ERROR(opt_in(reinterpret_cast<const void*>(LatentAttentionTcKernel), bytes, &tc_opted_in));
    const dim3 grid((shape.num_heads + kTcRows - 1) / kTcRows, splits, T);
    exl3::cuda::LaunchPdlWithSmem(LatentAttentionTcKernel, dim3(grid), dim3(kThreads), bytes, S(stream), q_latent, q,
                                  cache, tokens, sel, selection != nullptr, shape, splits, split_positions, scratch,
                                  out_latent);
    EXL3_RETURN_IF_ERROR(LaunchStatus("latent attention (tensor cores)"));
  } else {
    const int head_tile = std::min(kHeadTile, shape.num_heads);
    const size_t bytes = static_cast<size_t>(LatentSmem(head_tile, R, W).floats) * sizeof(float);
    static size_t opted_in = 48 << 10;
    EXL3_RETURN_IF_ERROR(opt_in(reinterpret_cast<const void*>(LatentAttentionKernel), bytes, &opted_in));
    const dim3 grid((shape.num_heads + head_tile - 1) / head_tile, splits, T);
    exl3::cuda::LaunchPdlWithSmem(LatentAttentionKernel, dim3(grid), dim3(kThreads), bytes, S(stream), q_latent, q,
                                  cache, tokens, sel, selection != nullptr, shape, head_tile, splits, split_positions,
                                  scratch, out_latent);
    EXL3_RETURN_IF_ERROR(LaunchStatus("latent attention"));
  }
  if (splits == 1) return absl::OkStatus();
  if (splits * sizeof(float) > (48 << 10))
    return absl::InvalidArgumentError(absl::StrCat("latent attention: ", splits, " splits (at most 12288)"));
  // Rounded up to whole 32-byte groups: the unrolled loop may read a group of weights at once.
  const size_t weights_bytes = (splits + 7) / 8 * 8 * sizeof(float);
  exl3::cuda::LaunchPdlWithSmem(LatentCombineKernel, dim3(shape.num_heads, T), dim3(std::min(R, 512)), weights_bytes,
                                S(stream), scratch, shape.num_heads, R, splits, out_latent);
  return LaunchStatus("latent attention combine");
}

}  // namespace exl3::engine::cuda
