// Grouped EXL3 GEMV on tensor cores: y[rows, n] += A[rows, k] (fp16, already input-transformed)
// times W_inner [k, n] decoded in registers from the trellis. Used for dense GEMV (one problem,
// implicit row chunks), batched active-expert GEMV and the MoE decode projections (chunks of up to
// 8 rows of one expert, built on the device by the routing kernel).
//
// Work unit (one warp): one row chunk (<= 8 rows: the N of mma.m16n8k16), kNT consecutive 16-wide
// column tiles, and a slice of k. The warp decodes each tile once into mma B fragments and issues
// 2 mma per tile; partial sums go to y with fp32 atomics (y is zeroed earlier in the sequence).
// Units are spread over all warps of the grid by static striding, so any number of active experts
// keeps every SM busy.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/trellis_decode.cuh"

namespace exl3::cuda {

inline constexpr int kGemvWarps = 8;   // warps per block
inline constexpr int kGemvNT = 4;      // column tiles per work unit (64 columns)
inline constexpr int kGemvRows = 8;    // rows (tokens) per chunk: the n = 8 side of the mma
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
  return p.chunk_expert ? *p.num_chunks : (p.rows + kGemvRows - 1) / kGemvRows;
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
  PdlEnter();
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
      row0 = chunk * kGemvRows;
      rows = min(kGemvRows, p.rows - row0);
    }
    const int kt0 = ks * p.k_tiles_per_unit;
    const int kt1 = min(k_tiles, kt0 + p.k_tiles_per_unit);
    const int n_tiles = p.n / 16;
    const uint32_t* tiles = reinterpret_cast<const uint32_t*>(p.chunk_expert ? p.trellis[expert] : p.single) +
                            (static_cast<size_t>(kt0) * n_tiles + cg * kGemvNT) * (8 * K);
    const size_t k_stride = static_cast<size_t>(n_tiles) * (8 * K);  // words per row of tiles
    // Operands swapped (y^T = W^T x^T): a lane's 8 decoded elements are exactly the A fragment of
    // W^T for mma.m16n8k16 (16 output columns x 16 k), and the tokens are the n = 8 side, so one
    // tile costs 2 mma (raw operands, see DecodeLaneRaw) per chunk of up to 8 tokens.
    const bool tok_ok = g < rows;
    const __half* x_row = p.a + static_cast<size_t>(row0 + (tok_ok ? g : 0)) * p.k + 2 * c;

    // acc[t]: tile t: {y[2c][g], y[2c+1][g], y[2c][g+8], y[2c+1][g+8]} (token, column).
    float acc[kGemvNT][4];
#pragma unroll
    for (int t = 0; t < kGemvNT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[t][i] = 0.f;

    // The unit's trellis words stream through a per-warp shared-memory ring (cp.async, kStages
    // deep): a k-step's kNT tiles are contiguous (8K * kNT words), so one 16-byte copy per lane
    // (two at K > 4) fetches them, several steps ahead of the decode.
    uint32_t* ring = gemv_ring + (threadIdx.x >> 5) * (kGemvStages * kStageWords);
    uint32_t* const ring_end = ring + kGemvStages * kStageWords;
    // Running pointers (no per-step index arithmetic): the slot to fill next and its source.
    uint32_t* fill = ring;
    const uint32_t* src = tiles;
    auto issue = [&](bool valid) {
      if (valid) {
#pragma unroll
        for (int piece = lane; piece < kStageWords / 4; piece += 32) CpAsync16(fill + 4 * piece, src + 4 * piece);
      }
      CpAsyncCommitGroup();
      src += k_stride;
      fill = (fill + kStageWords == ring_end) ? ring : fill + kStageWords;
    };
#pragma unroll
    for (int s = 0; s < kGemvStages - 1; ++s) issue(kt0 + s < kt1);

    // MUL1: the raw operand is 1024 + byte sum; weight = scale * raw + bias, so the bias needs
    // the token sums of x over this k-slice (one extra mma per k-step with A = ones).
    float rowsum[4] = {0.f, 0.f, 0.f, 0.f};
    const uint32_t ones[4] = {0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u};
    const uint32_t mask = 0x8fff8fffu, flip = 0x3b603b60u;
    const __half* xp = x_row + kt0 * 16;
    uint32_t x_next[2];
    x_next[0] = tok_ok ? *reinterpret_cast<const uint32_t*>(xp) : 0u;
    x_next[1] = tok_ok ? *reinterpret_cast<const uint32_t*>(xp + 8) : 0u;
    const uint32_t* stage = ring;
    for (int kt = kt0; kt < kt1; ++kt) {
      const uint32_t x[2] = {x_next[0], x_next[1]};
      xp += 16;
      if (kt + 1 < kt1 && tok_ok) {
        x_next[0] = *reinterpret_cast<const uint32_t*>(xp);
        x_next[1] = *reinterpret_cast<const uint32_t*>(xp + 8);
      }
      uint32_t even[2], odd[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        even[i] = __byte_perm(x[i], x[i], 0x1010);
        odd[i] = __byte_perm(x[i], x[i], 0x3232);
      }
      if constexpr (CB == kCbMul1) Mma16816(rowsum, ones, x[0], x[1]);
      CpAsyncWaitGroup<kGemvStages - 2>();
      // Makes every lane's copies visible, and guarantees that every lane has finished reading
      // the slot that the issue below overwrites (it was read in the previous step).
      __syncwarp();
#pragma unroll
      for (int t = 0; t < kGemvNT; ++t) {
        uint32_t w[LaneSlots<K>::kWords];
#pragma unroll
        for (int i = 0; i < LaneSlots<K>::kWords; ++i) w[i] = stage[t * 8 * K + slots.idx[i]];
        uint32_t b[8];
        DecodeLaneRaw<K, CB>(w, slots.shift, mask, flip, batch.pow2, b);
        const uint32_t ae[4] = {b[0], b[4], b[2], b[6]};
        const uint32_t ao[4] = {b[1], b[5], b[3], b[7]};
        Mma16816(acc[t], ae, even[0], even[1]);
        Mma16816(acc[t], ao, odd[0], odd[1]);
      }
      stage = (stage + kStageWords == ring_end) ? ring : stage + kStageWords;
      issue(kt + kGemvStages - 1 < kt1);
    }
    CpAsyncWaitGroup<0>();
    __syncwarp();
    if constexpr (CB == kCbMul1) {
      const float scale = __half2float(__ushort_as_half(0x1eee)), bias = __half2float(__ushort_as_half(0xc931));
#pragma unroll
      for (int t = 0; t < kGemvNT; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[t][i] = fmaf(scale, acc[t][i], bias * rowsum[i & 1]);
    }

    const int t0 = 2 * c, t1 = t0 + 1;  // token rows inside the chunk
    float* y0 = p.y + static_cast<size_t>(row0 + t0) * p.n;
    float* y1 = p.y + static_cast<size_t>(row0 + t1) * p.n;
#pragma unroll
    for (int t = 0; t < kGemvNT; ++t) {
      const int col = 16 * (cg * kGemvNT + t) + g;
      if (t0 < rows) {
        atomicAdd(y0 + col, acc[t][0]);
        atomicAdd(y0 + col + 8, acc[t][2]);
      }
      if (t1 < rows) {
        atomicAdd(y1 + col, acc[t][1]);
        atomicAdd(y1 + col + 8, acc[t][3]);
      }
    }
  }
}

template <int K, int CB>
void LaunchGroupedGemv(const GemvBatch& batch, int grid, cudaStream_t stream) {
  LaunchPdl(GroupedGemvKernel<K, CB>, dim3(grid), dim3(kGemvWarps * 32), stream, batch);
}

}  // namespace exl3::cuda
