#include "engine/cuda/dsv4_attention_kernels.h"

#include <cuda_runtime.h>

#include <cmath>

#include "absl/strings/str_cat.h"
#include "engine/cuda/launch_status.cuh"
#include "engine/cuda/block_reduce.cuh"

namespace exl3::engine::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = 4;  // attention and index scores: blocks of four warps

__device__ inline float* BlockOf(const Dsv4CacheView& c, const int32_t* table, int position) {
  return c.layer + static_cast<size_t>(table[position / c.block_size]) * c.block_stride;
}
__device__ inline float* SlotOf(const Dsv4CacheView& c, const int32_t* table, int position) {
  return BlockOf(c, table, position) + static_cast<size_t>(position % c.block_size) * c.token_floats;
}
__device__ inline float* AreaOf(const Dsv4CacheView& c, const int32_t* table, int position) {
  return BlockOf(c, table, position) + static_cast<size_t>(c.block_size) * c.token_floats;
}
// Entry w of a compressor of rate m whose entries start at `offset` in the area, `dim` floats.
__device__ inline float* EntryOf(const Dsv4CacheView& c, const int32_t* table, int w, int m, int offset, int dim) {
  const int last = w * m + m - 1;
  return AreaOf(c, table, last) + offset + static_cast<size_t>((last % c.block_size) / m) * dim;
}

// Rotates the last rope_dim of v [dim] (pairs 2i, 2i + 1) by cos/sin (sign -1: back); the block's
// threads take the pairs. v is read and written by this block only.
__device__ void RotateTailBlock(float* v, int dim, int rope_dim, const float* cos, const float* sin, float sign) {
  float* r = v + dim - rope_dim;
  for (int i = threadIdx.x; i < rope_dim / 2; i += blockDim.x) {
    const float c = cos[i], s = sign * sin[i];
    const float x0 = r[2 * i], x1 = r[2 * i + 1];
    r[2 * i] = x0 * c - x1 * s;
    r[2 * i + 1] = x1 * c + x0 * s;
  }
}

// grid (rows, heads), block kThreads.
__global__ void RotateTailKernel(float* x, int heads, int dim, int rope_dim, const float* cos, const float* sin,
                                 float sign, bool normalize, float eps) {
  __shared__ double partial[32];
  float* v = x + (static_cast<size_t>(blockIdx.x) * heads + blockIdx.y) * dim;
  if (normalize) {
    double ss = 0.0;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += static_cast<double>(v[i]) * v[i];
    ss = BlockSumDouble(ss, partial);
    const float inv = static_cast<float>(1.0 / sqrt(ss / dim + eps));
    for (int i = threadIdx.x; i < dim; i += blockDim.x) v[i] *= inv;
    __syncthreads();
  }
  const size_t half = rope_dim / 2;
  RotateTailBlock(v, dim, rope_dim, cos + blockIdx.x * half, sin + blockIdx.x * half, sign);
}

// grid T, block kThreads.
__global__ void WriteSlotsKernel(const float* kv, AttentionTokens at, Dsv4CacheView c) {
  const int t = blockIdx.x;
  float* slot = SlotOf(c, at.tables + at.table_offset[t], at.position[t]);
  const float* v = kv + static_cast<size_t>(t) * c.token_floats;
  for (int i = threadIdx.x; i < c.token_floats; i += blockDim.x) slot[i] = v[i];
}

// Folds (value, logit) into channel i of a running softmax acc [2, n] (FoldIntoAccumulator of
// engine/cpu/attention/dsv4_attention.cc).
__device__ inline void FoldChannel(float* acc, int n, int i, float value, float logit) {
  float* lse = acc;
  float* mean = acc + n;
  const float old = lse[i];
  if (old == -INFINITY) {
    lse[i] = logit;
    mean[i] = value;
    return;
  }
  const float hi = fmaxf(old, logit), lo = fminf(old, logit);
  const float merged = hi + log1pf(expf(lo - hi));
  mean[i] = mean[i] * expf(old - merged) + value * expf(logit - merged);
  lse[i] = merged;
}

__device__ inline void ClearChannel(float* acc, int n, int i) {
  acc[i] = -INFINITY;
  acc[n + i] = 0.0f;
}

// FoldPosition of engine/cpu/attention/dsv4_attention.cc for token t at `position` into `area`, by the block.
__device__ void FoldCompressor(const Dsv4CompressorArgs& k, const Dsv4FoldArgs& a, const Dsv4CacheView& c, int t,
                               int position, float* area, const float* entry_cos, const float* entry_sin,
                               double* partial) {
  const int d = k.dim, W = k.overlapping ? 2 * d : d, m = a.rate, j = position % m;
  const float* kv = k.kv + static_cast<size_t>(t) * W;
  const float* gate = k.gate + static_cast<size_t>(t) * W;
  const float* ape = k.ape + static_cast<size_t>(j) * W;
  float* current = area + k.current;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    if (k.overlapping) {
      // The first half of window w's channels starts entry w + 1, the second half ends entry w.
      float* next = area + k.next;
      if (j == 0) {
        current[i] = next[i];
        current[d + i] = next[d + i];
        ClearChannel(next, d, i);
      }
      FoldChannel(current, d, i, kv[d + i], gate[d + i] + ape[d + i]);
      FoldChannel(next, d, i, kv[i], gate[i] + ape[i]);
    } else {
      if (j == 0) ClearChannel(current, d, i);
      FoldChannel(current, d, i, kv[i], gate[i] + ape[i]);
    }
  }
  if (j != m - 1) return;  // uniform over the block
  __syncthreads();         // every channel's mean folded
  float* dest = area + k.entries + static_cast<size_t>((position % c.block_size) / m) * d;
  const float* mean = current + d;
  double ss = 0.0;
  for (int i = threadIdx.x; i < d; i += blockDim.x) ss += static_cast<double>(mean[i]) * mean[i];
  ss = BlockSumDouble(ss, partial);
  const float inv = static_cast<float>(1.0 / sqrt(ss / d + a.eps));
  for (int i = threadIdx.x; i < d; i += blockDim.x) dest[i] = k.norm[i] * (mean[i] * inv);
  __syncthreads();
  const size_t half = a.rope_dim / 2;
  RotateTailBlock(dest, d, a.rope_dim, entry_cos + t * half, entry_sin + t * half, 1.0f);
}

// grid num_chunks, block kThreads.
__global__ void FoldKernel(Dsv4FoldArgs a, Dsv4CacheView c, AttentionTokens at, const int32_t* chunk_start,
                           const float* entry_cos, const float* entry_sin, int32_t* error) {
  __shared__ double partial[32];
  __shared__ int verdict;  // 0 fold, 1 skip (folded before), 2 stop, 3 restore the kept state, then fold
  const int t0 = chunk_start[blockIdx.x], t1 = chunk_start[blockIdx.x + 1];
  const int B = c.block_size;
  const int kept_floats = a.accumulators_end - (a.folded + 1);
  const bool keeping = a.kept != nullptr && a.chunk_keeping != nullptr;
  int restore = -1, keep_from = t1, first_row = 0;
  if (keeping) {
    const int32_t* k = a.chunk_keeping + static_cast<size_t>(blockIdx.x) * kDsv4KeepingInts;
    restore = k[0];
    keep_from = k[1];
    first_row = k[2];
  }
  for (int t = t0; t < t1; ++t) {
    const int pos = at.position[t], local = pos % B;
    const int32_t* table = at.tables + at.table_offset[t];
    float* area = AreaOf(c, table, pos);
    __syncthreads();  // the previous token's writes are done
    if (threadIdx.x == 0) {
      const int folded = static_cast<int>(area[a.folded]);
      int v = 0, code = 0;
      if (local == 0) {
        if (pos > 0 && static_cast<int>(AreaOf(c, table, pos - 1)[a.folded]) != B) code = 1;
      } else if (local < folded) {
        // The block went past this position: drafts the scheduler rejected (their verify chunk
        // kept the state before them), or else an earlier run of this same step, whose folds stand.
        v = t == t0 && restore >= 0 ? 3 : 1;
      } else if (local > folded) {
        code = 2;
      }
      if (code != 0) {
        atomicCAS(error, 0, code);
        v = 2;
      }
      verdict = v;
    }
    __syncthreads();
    if (verdict == 2) return;
    if (verdict == 1) continue;
    if (verdict == 3) {
      const float* from = a.kept + static_cast<size_t>(restore) * kept_floats;
      for (int i = threadIdx.x; i < kept_floats; i += blockDim.x) area[a.folded + 1 + i] = from[i];
      __syncthreads();
    }
    if (local == 0) {
      // A block starts from its predecessor's state after that block's last position (from empty
      // accumulators at position 0).
      if (pos == 0) {
        const Dsv4CompressorArgs* both[2] = {&a.compressor, &a.indexer};
        for (const Dsv4CompressorArgs* k : both) {
          if (k->dim == 0) continue;
          for (int i = threadIdx.x; i < k->dim; i += blockDim.x) {
            ClearChannel(area + k->current, k->dim, i);
            if (k->overlapping) ClearChannel(area + k->next, k->dim, i);
          }
        }
      } else {
        const float* prev = AreaOf(c, table, pos - 1);
        for (int i = a.folded + 1 + threadIdx.x; i < a.accumulators_end; i += blockDim.x) area[i] = prev[i];
      }
      __syncthreads();
    }
    FoldCompressor(a.compressor, a, c, t, pos, area, entry_cos, entry_sin, partial);
    if (a.indexer.dim > 0) {
      __syncthreads();
      FoldCompressor(a.indexer, a, c, t, pos, area, entry_cos, entry_sin, partial);
    }
    __syncthreads();
    if (threadIdx.x == 0) area[a.folded] = static_cast<float>(local + 1);
    // A later chunk may resume after any kept row but the last (the live state); at a block's end
    // the next block's start continues from this one's full state.
    if (t >= keep_from && t + 1 < t1 && local + 1 < B) {
      int row = first_row + (t - keep_from);
      if (restore >= 0 && row >= restore) ++row;
      float* to = a.kept + static_cast<size_t>(row) * kept_floats;
      for (int i = threadIdx.x; i < kept_floats; i += blockDim.x) to[i] = area[a.folded + 1 + i];
    }
  }
}

// grid (tokens, blocks_per_token), kWarps warps. Shared: q [heads, head_dim + 1], the head
// weights [heads], a key per warp [kWarps, head_dim], the heads' terms per warp [kWarps, heads].
__global__ void IndexScoresKernel(const float* q, const float* weights, float head_weight, float scale,
                                  Dsv4CacheView c, AttentionTokens at, const int32_t* last_entry, Dsv4IndexShape s,
                                  int first_token, float* scores, int row_length) {
  extern __shared__ float ix_smem[];
  const int NI = s.heads, DI = s.head_dim;
  const int t = first_token + blockIdx.x;
  const int n = min(last_entry[t] + 1, row_length);
  if (n <= s.topk) return;
  float* qs = ix_smem;
  float* wt = qs + NI * (DI + 1);
  float* keys = wt + NI;
  float* terms = keys + kWarps * DI;
  for (int e = threadIdx.x; e < NI * DI; e += blockDim.x)
    qs[(e / DI) * (DI + 1) + e % DI] = q[static_cast<size_t>(t) * NI * DI + e];
  for (int h = threadIdx.x; h < NI; h += blockDim.x) wt[h] = weights[static_cast<size_t>(t) * NI + h] * head_weight;
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* key = keys + warp * DI;
  float* term = terms + warp * NI;
  const int32_t* table = at.tables + at.table_offset[t];
  float* row = scores + static_cast<size_t>(blockIdx.x) * row_length;
  for (int e = blockIdx.y * kWarps + warp; e < n; e += gridDim.y * kWarps) {
    const float* k = EntryOf(c, table, e, s.rate, s.entries, DI);
    for (int d = lane; d < DI; d += 32) key[d] = k[d];
    __syncwarp();
    for (int h = lane; h < NI; h += 32) {
      const float* qh = qs + h * (DI + 1);
      float dot = 0.0f;
      for (int d = 0; d < DI; ++d) dot += qh[d] * key[d];
      term[h] = fmaxf(dot, 0.0f) * scale * wt[h];
    }
    __syncwarp();
    if (lane == 0) {
      float sum = 0.0f;
      for (int h = 0; h < NI; ++h) sum += term[h];
      row[e] = sum;
    }
    __syncwarp();
  }
}

// grid (T, heads), kWarps warps; each warp an online softmax over every kWarps-th key, then the
// warps merged with the sink. Per lane: dimensions lane + 32 i, i < kPerLane. Shared: per warp
// its max and sum [kWarps] and output [kWarps, dim]; the output row [dim].
template <int kPerLane>
__global__ void AttentionKernel(const float* q, const float* sinks, Dsv4CacheView c, AttentionTokens at,
                                Dsv4Entries entries, int heads, int dim, int rope_dim, float scale, const float* cos,
                                const float* sin, float* out) {
  extern __shared__ float at_smem[];
  float* wmax = at_smem;
  float* wsum = wmax + kWarps;
  float* wacc = wsum + kWarps;
  float* o = wacc + kWarps * dim;
  const int t = blockIdx.x, h = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int pos = at.position[t], first = at.first_visible[t];
  const int window = pos - first + 1;
  int n_entries = 0;
  if (entries.rate > 0) n_entries = entries.selected != nullptr ? entries.count[t] : (pos + 1) / entries.rate;
  const int total = window + n_entries;
  const int32_t* table = at.tables + at.table_offset[t];
  const float* qh = q + (static_cast<size_t>(t) * heads + h) * dim;
  float qv[kPerLane], acc[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int d = lane + 32 * i;
    qv[i] = d < dim ? qh[d] : 0.0f;
    acc[i] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  for (int j = warp; j < total; j += kWarps) {
    const float* k;
    if (j < window) {
      k = SlotOf(c, table, first + j);
    } else {
      const int e = entries.selected != nullptr
                        ? entries.selected[static_cast<size_t>(t) * entries.stride + (j - window)]
                        : j - window;
      k = EntryOf(c, table, e, entries.rate, entries.offset, dim);
    }
    float kv[kPerLane];
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int d = lane + 32 * i;
      kv[i] = d < dim ? k[d] : 0.0f;
      dot += qv[i] * kv[i];
    }
    for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
    const float s = dot * scale;
    const float mn = fmaxf(m, s);
    const float corr = expf(m - mn), p = expf(s - mn);
    l = l * corr + p;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) acc[i] = acc[i] * corr + p * kv[i];
    m = mn;
  }
  if (lane == 0) {
    wmax[warp] = m;
    wsum[warp] = l;
  }
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int d = lane + 32 * i;
    if (d < dim) wacc[warp * dim + d] = acc[i];
  }
  __syncthreads();
  const float sink = sinks[h];
  float M = sink;
  for (int w = 0; w < kWarps; ++w) M = fmaxf(M, wmax[w]);
  float L = expf(sink - M);  // the sink takes its share of the softmax and gives no value
  float f[kWarps];
  for (int w = 0; w < kWarps; ++w) {
    f[w] = wmax[w] == -INFINITY ? 0.0f : expf(wmax[w] - M);
    L += wsum[w] * f[w];
  }
  for (int d = threadIdx.x; d < dim; d += blockDim.x) {
    float v = 0.0f;
    for (int w = 0; w < kWarps; ++w) v += wacc[w * dim + d] * f[w];
    o[d] = v / L;
  }
  __syncthreads();
  const size_t half = rope_dim / 2;
  RotateTailBlock(o, dim, rope_dim, cos + t * half, sin + t * half, -1.0f);
  __syncthreads();
  float* y = out + (static_cast<size_t>(t) * heads + h) * dim;
  for (int d = threadIdx.x; d < dim; d += blockDim.x) y[d] = o[d];
}

}  // namespace

absl::Status Dsv4RotateTail(float* x, int rows, int heads, int dim, int rope_dim, const float* cos,
                            const float* sin, float sign, bool normalize, float eps, StreamHandle stream) {
  if (rows == 0 || heads == 0) return absl::OkStatus();
  if (rope_dim > dim || rope_dim % 2 != 0)
    return absl::InvalidArgumentError(absl::StrCat("rope tail: ", rope_dim, " of ", dim, " dimensions"));
  RotateTailKernel<<<dim3(rows, heads), kThreads, 0, S(stream)>>>(x, heads, dim, rope_dim, cos, sin, sign,
                                                                  normalize, eps);
  return LaunchStatus("dsv4 rope tail");
}

absl::Status Dsv4WriteSlots(const float* kv, int T, const AttentionTokens& tokens, const Dsv4CacheView& cache,
                            StreamHandle stream) {
  if (T == 0) return absl::OkStatus();
  WriteSlotsKernel<<<T, kThreads, 0, S(stream)>>>(kv, tokens, cache);
  return LaunchStatus("dsv4 kv write");
}

absl::Status Dsv4Fold(const Dsv4FoldArgs& args, const Dsv4CacheView& cache, const AttentionTokens& tokens,
                      const int32_t* chunk_start, int num_chunks, const float* entry_cos, const float* entry_sin,
                      int32_t* error, StreamHandle stream) {
  if (num_chunks == 0) return absl::OkStatus();
  if (args.rate < 1 || args.compressor.dim == 0)
    return absl::InvalidArgumentError("dsv4 fold: a compressed layer needs its rate and compressor");
  FoldKernel<<<num_chunks, kThreads, 0, S(stream)>>>(args, cache, tokens, chunk_start, entry_cos, entry_sin, error);
  return LaunchStatus("dsv4 compressor fold");
}

absl::Status Dsv4IndexScores(const float* q, const float* weights, float head_weight, float scale,
                             const Dsv4CacheView& cache, const AttentionTokens& tokens, const int32_t* last_entry,
                             const Dsv4IndexShape& shape, int first_token, int num_tokens, int blocks_per_token,
                             float* scores, int row_length, StreamHandle stream) {
  if (num_tokens == 0) return absl::OkStatus();
  const size_t smem = (static_cast<size_t>(shape.heads) * (shape.head_dim + 1) + shape.heads +
                       kWarps * shape.head_dim + kWarps * shape.heads) * sizeof(float);
  if (smem > 48 * 1024)
    return absl::UnimplementedError(absl::StrCat("dsv4 index scores: ", shape.heads, " heads of ", shape.head_dim,
                                                 " need ", smem, " bytes of shared memory (48 KiB here)"));
  IndexScoresKernel<<<dim3(num_tokens, blocks_per_token), kWarps * 32, smem, S(stream)>>>(
      q, weights, head_weight, scale, cache, tokens, last_entry, shape, first_token, scores, row_length);
  return LaunchStatus("dsv4 index scores");
}

absl::Status Dsv4Attend(const float* q, const float* sinks, const Dsv4CacheView& cache,
                        const AttentionTokens& tokens, const Dsv4Entries& entries, int T, int heads, int dim,
                        int rope_dim, float scale, const float* cos, const float* sin, float* out,
                        StreamHandle stream) {
  if (T == 0) return absl::OkStatus();
  if (dim % 32 != 0 || dim > 512 || rope_dim > dim)
    return absl::UnimplementedError(absl::StrCat("dsv4 attention: head_dim ", dim,
                                                 " (a multiple of 32 up to 512 on the GPU)"));
  const size_t smem = (2 * kWarps + static_cast<size_t>(kWarps + 1) * dim) * sizeof(float);
  const dim3 grid(T, heads);
  if (dim <= 128) {
    AttentionKernel<4><<<grid, kWarps * 32, smem, S(stream)>>>(q, sinks, cache, tokens, entries, heads, dim,
                                                               rope_dim, scale, cos, sin, out);
  } else if (dim <= 256) {
    AttentionKernel<8><<<grid, kWarps * 32, smem, S(stream)>>>(q, sinks, cache, tokens, entries, heads, dim,
                                                               rope_dim, scale, cos, sin, out);
  } else {
    AttentionKernel<16><<<grid, kWarps * 32, smem, S(stream)>>>(q, sinks, cache, tokens, entries, heads, dim,
                                                                rope_dim, scale, cos, sin, out);
  }
  return LaunchStatus("dsv4 attention");
}

}  // namespace exl3::engine::cuda
