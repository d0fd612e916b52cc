// Grouped EXL3 GEMV on tensor cores: y[rows, n] += A[rows, k] (fp16, already input-transformed)
// times W_inner [k, n] decoded in registers from the trellis. Used for dense GEMV (one problem,
// implicit row chunks), batched active-expert GEMV and the MoE decode projections (chunks of up to
// 16 rows of one expert, built on the device by the routing kernel).
//
// Work unit (one warp): one row chunk (<= 16 rows: the M of mma.m16n8k16), kNT consecutive 16-wide
// column tiles, and a slice of k. The warp decodes each tile once into mma B fragments and issues
// 2 mma per tile; partial sums go to y with fp32 atomics (y is zeroed earlier in the sequence).
// Units are spread over all warps of the grid by static striding, so any number of active experts
// keeps every SM busy.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/cuda/trellis_decode.cuh"

namespace exl3::cuda {

inline constexpr int kGemvWarps = 8;   // warps per block
inline constexpr int kGemvNT = 4;      // column tiles per work unit (64 columns)
inline constexpr int kMaxProblems = 4;
inline constexpr int kGemmBM = 128;    // rows per prefill GEMM unit (gemm_kernel.cuh)

struct GemvProblem {
  const uint16_t* const* trellis = nullptr;  // device array: per-expert trellis [k/16, n/16, 16K]
  const uint16_t* single = nullptr;          // the trellis when chunks are implicit (one expert)
  const __half* a = nullptr;                 // [rows, k] fp16, transformed input
  float* y = nullptr;                        // [rows, n] fp32, accumulated atomically
  // Row chunks. With chunk_expert null: implicit chunks of 16 rows over `rows`, expert 0.
  const int* chunk_expert = nullptr;
  const int* chunk_row0 = nullptr;
  const int* chunk_rows = nullptr;
  const int* num_chunks = nullptr;  // device count (with chunk arrays)
  int rows = 0;                     // implicit chunks: total rows
  int k = 0, n = 0;
  int k_tiles_per_unit = 0;  // k-slice length in 16-row tiles
};

struct GemvBatch {
  GemvProblem p[kMaxProblems];
  int num_problems = 0;
};

__device__ __forceinline__ int ProblemChunks(const GemvProblem& p) {
  return p.chunk_expert ? *p.num_chunks : (p.rows + 15) / 16;
}

template <int K, int CB>
__global__ void __launch_bounds__(kGemvWarps * 32) GroupedGemvKernel(const GemvBatch batch) {
  const int lane = threadIdx.x & 31;
  const int warp_global = blockIdx.x * kGemvWarps + (threadIdx.x >> 5);
  const int total_warps = gridDim.x * kGemvWarps;
  const LaneSlots<K> slots(lane);
  const int g = lane >> 2, c = lane & 3;

  // Units per problem (chunks * column groups * k slices), computed the same way by every warp.
  int units[kMaxProblems];
  int total = 0;
#pragma unroll
  for (int q = 0; q < kMaxProblems; ++q) {
    units[q] = 0;
    if (q < batch.num_problems) {
      const GemvProblem& p = batch.p[q];
      const int col_groups = p.n / (16 * kGemvNT);
      const int k_slices = (p.k / 16 + p.k_tiles_per_unit - 1) / p.k_tiles_per_unit;
      units[q] = ProblemChunks(p) * col_groups * k_slices;
      total += units[q];
    }
  }

  for (int u = warp_global; u < total; u += total_warps) {
    int q = 0, r = u;
#pragma unroll
    for (int i = 0; i < kMaxProblems - 1; ++i) {
      if (q == i && r >= units[i]) {
        r -= units[i];
        q = i + 1;
      }
    }
    const GemvProblem& p = batch.p[q];
    const int col_groups = p.n / (16 * kGemvNT);
    const int k_tiles = p.k / 16;
    const int k_slices = (k_tiles + p.k_tiles_per_unit - 1) / p.k_tiles_per_unit;
    const int ks = r % k_slices;
    const int cg = (r / k_slices) % col_groups;
    const int chunk = r / (k_slices * col_groups);
    int expert, row0, rows;
    if (p.chunk_expert) {
      expert = p.chunk_expert[chunk];
      row0 = p.chunk_row0[chunk];
      rows = p.chunk_rows[chunk];
    } else {
      expert = 0;
      row0 = chunk * 16;
      rows = min(16, p.rows - row0);
    }
    const int kt0 = ks * p.k_tiles_per_unit;
    const int kt1 = min(k_tiles, kt0 + p.k_tiles_per_unit);
    const int n_tiles = p.n / 16;
    const uint32_t* tiles = reinterpret_cast<const uint32_t*>(p.chunk_expert ? p.trellis[expert] : p.single) +
                            (static_cast<size_t>(kt0) * n_tiles + cg * kGemvNT) * (8 * K);
    const size_t k_stride = static_cast<size_t>(n_tiles) * (8 * K);  // words per row of tiles
    const bool row_lo = g < rows, row_hi = g + 8 < rows;
    const __half* a_lo = p.a + static_cast<size_t>(row0 + (row_lo ? g : 0)) * p.k + 2 * c;
    const __half* a_hi = p.a + static_cast<size_t>(row0 + (row_hi ? g + 8 : 0)) * p.k + 2 * c;

    float acc[kGemvNT][2][4];
#pragma unroll
    for (int t = 0; t < kGemvNT; ++t)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[t][h][i] = 0.f;

    uint32_t w[kGemvNT][LaneSlots<K>::kWords];
#pragma unroll
    for (int t = 0; t < kGemvNT; ++t) LoadLaneWords<K>(tiles + t * 8 * K, slots, w[t]);

    for (int kt = kt0; kt < kt1; ++kt) {
      uint32_t a[4];
      const int off = kt * 16;
      a[0] = row_lo ? *reinterpret_cast<const uint32_t*>(a_lo + off) : 0u;
      a[1] = row_hi ? *reinterpret_cast<const uint32_t*>(a_hi + off) : 0u;
      a[2] = row_lo ? *reinterpret_cast<const uint32_t*>(a_lo + off + 8) : 0u;
      a[3] = row_hi ? *reinterpret_cast<const uint32_t*>(a_hi + off + 8) : 0u;
      // Prefetch next k-step's words while this one decodes.
      uint32_t wn[kGemvNT][LaneSlots<K>::kWords];
      const bool more = kt + 1 < kt1;
      const uint32_t* next = tiles + k_stride;
#pragma unroll
      for (int t = 0; t < kGemvNT; ++t) {
        if (more) LoadLaneWords<K>(next + t * 8 * K, slots, wn[t]);
      }
#pragma unroll
      for (int t = 0; t < kGemvNT; ++t) {
        uint32_t b[4];
        DecodeLane<K, CB>(w[t], slots.shift, b);
        Mma16816(acc[t][0], a, b[0], b[1]);
        Mma16816(acc[t][1], a, b[2], b[3]);
      }
#pragma unroll
      for (int t = 0; t < kGemvNT; ++t)
#pragma unroll
        for (int i = 0; i < LaneSlots<K>::kWords; ++i) w[t][i] = wn[t][i];
      tiles = next;
    }

    // acc[t][h]: rows g (i=0,1) and g+8 (i=2,3), columns 16*(cg*NT+t) + 8h + 2c + {0,1}.
    float* y_lo = p.y + static_cast<size_t>(row0 + g) * p.n;
    float* y_hi = p.y + static_cast<size_t>(row0 + g + 8) * p.n;
#pragma unroll
    for (int t = 0; t < kGemvNT; ++t) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int col = 16 * (cg * kGemvNT + t) + 8 * h + 2 * c;
        if (row_lo) {
          atomicAdd(y_lo + col, acc[t][h][0]);
          atomicAdd(y_lo + col + 1, acc[t][h][1]);
        }
        if (row_hi) {
          atomicAdd(y_hi + col, acc[t][h][2]);
          atomicAdd(y_hi + col + 1, acc[t][h][3]);
        }
      }
    }
  }
}

template <int K, int CB>
void LaunchGroupedGemv(const GemvBatch& batch, int grid, cudaStream_t stream) {
  GroupedGemvKernel<K, CB><<<grid, kGemvWarps * 32, 0, stream>>>(batch);
}

}  // namespace exl3::cuda
