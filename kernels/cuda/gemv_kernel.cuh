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
inline constexpr int kGemvStages = 4;  // cp.async pipeline depth (k-steps in flight per warp)
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
  Pow2Table pow2 = Pow2Table::Make();
};

__device__ __forceinline__ int ProblemChunks(const GemvProblem& p) {
  return p.chunk_expert ? *p.num_chunks : (p.rows + 15) / 16;
}

__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void CpAsyncCommitGroup() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void CpAsyncWaitGroup() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

template <int K, int CB>
__global__ void __launch_bounds__(kGemvWarps * 32, 3) GroupedGemvKernel(const GemvBatch batch) {
  constexpr int kStageWords = kGemvNT * 8 * K;
  __shared__ __align__(16) uint32_t gemv_ring[kGemvWarps * kGemvStages * kStageWords];
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

    // The unit's trellis words stream through a per-warp shared-memory ring (cp.async, kStages
    // deep): a k-step's kNT tiles are contiguous (8K * kNT words), so one 16-byte copy per lane
    // (two at K > 4) fetches them, several steps ahead of the decode.
    uint32_t* ring = gemv_ring + (threadIdx.x >> 5) * (kGemvStages * kStageWords);
    auto issue = [&](int kt) {
      if (kt < kt1) {
        const uint32_t* src = tiles + static_cast<size_t>(kt - kt0) * k_stride;
        uint32_t* dst = ring + ((kt - kt0) % kGemvStages) * kStageWords;
#pragma unroll
        for (int piece = lane; piece < kStageWords / 4; piece += 32) CpAsync16(dst + 4 * piece, src + 4 * piece);
      }
      CpAsyncCommitGroup();
    };
#pragma unroll
    for (int s = 0; s < kGemvStages - 1; ++s) issue(kt0 + s);

    // MUL1: the raw operand is 1024 + byte sum; weight = scale * raw + bias, so the bias needs
    // the row sums of A over this k-slice (one extra mma per k-step with B = ones).
    float rowsum[4] = {0.f, 0.f, 0.f, 0.f};
    const uint32_t mask = 0x8fff8fffu, flip = 0x3b603b60u;
    uint32_t a_next[4];
    auto load_a = [&](int kt, uint32_t (&a)[4]) {
      const int off = kt * 16;
      a[0] = row_lo ? *reinterpret_cast<const uint32_t*>(a_lo + off) : 0u;
      a[1] = row_hi ? *reinterpret_cast<const uint32_t*>(a_hi + off) : 0u;
      a[2] = row_lo ? *reinterpret_cast<const uint32_t*>(a_lo + off + 8) : 0u;
      a[3] = row_hi ? *reinterpret_cast<const uint32_t*>(a_hi + off + 8) : 0u;
    };
    load_a(kt0, a_next);
    for (int kt = kt0; kt < kt1; ++kt) {
      uint32_t a[4] = {a_next[0], a_next[1], a_next[2], a_next[3]};
      if (kt + 1 < kt1) load_a(kt + 1, a_next);
      uint32_t even[4], odd[4];
      SplitA(a, even, odd);
      if constexpr (CB == kCbMul1) Mma16816(rowsum, a, 0x3c003c00u, 0x3c003c00u);
      CpAsyncWaitGroup<kGemvStages - 2>();
      __syncwarp();
      const uint32_t* stage = ring + ((kt - kt0) % kGemvStages) * kStageWords;
#pragma unroll
      for (int t = 0; t < kGemvNT; ++t) {
        uint32_t w[LaneSlots<K>::kWords];
#pragma unroll
        for (int i = 0; i < LaneSlots<K>::kWords; ++i) w[i] = stage[t * 8 * K + slots.idx[i]];
        uint32_t b[8];
        DecodeLaneRaw<K, CB>(w, slots.shift, mask, flip, batch.pow2, b);
        MmaTileRaw(acc[t], even, odd, b);
      }
      __syncwarp();
      issue(kt + kGemvStages - 1);
    }
    CpAsyncWaitGroup<0>();
    __syncwarp();
    if constexpr (CB == kCbMul1) {
      const float scale = __half2float(__ushort_as_half(0x1eee)), bias = __half2float(__ushort_as_half(0xc931));
#pragma unroll
      for (int t = 0; t < kGemvNT; ++t)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[t][h][i] = fmaf(scale, acc[t][h][i], bias * rowsum[i]);
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
