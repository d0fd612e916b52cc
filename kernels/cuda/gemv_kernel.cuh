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
inline constexpr int kGemmStageK = 64;  // k per GEMM pipeline stage (4 tiles)

struct GemvProblem {
  const uint16_t* const* trellis = nullptr;  // device array: per-expert trellis [k/16, n/16, 16K]
  const uint16_t* single = nullptr;          // the trellis when chunks are implicit (one expert)
  const __half* a = nullptr;                 // [rows, k] fp16, transformed input
  float* y = nullptr;                        // [rows, n] fp32, accumulated atomically
  // Row chunks. With chunk_expert null: implicit chunks of kGemvRows rows over `rows`, expert 0.
  const int* chunk_expert = nullptr;
  const int* chunk_row0 = nullptr;
  const int* chunk_rows = nullptr;
  const int* num_chunks = nullptr;  // device count (with chunk arrays)
  // Device index of the problem's first chunk in the chunk arrays (null: 0): one (K, codebook)
  // class of a mixed MoE layer (moe_layer.h) covers the chunks [*chunk_base, + *num_chunks).
  const int* chunk_base = nullptr;
  int rows = 0;                     // implicit chunks: total rows
  int k = 0, n = 0;
  int k_tiles_per_unit = 0;  // GEMV: k-slice length in 16-row tiles
  // GEMM (gemm_kernel.cuh): k-slice length in stages of 64 k; 0: all of k (y stored, not added to).
  int gemm_k_stages = 0;
};

struct GemvBatch {
  GemvProblem p[kMaxProblems];
  int num_problems = 0;
  Pow2Table pow2 = Pow2Table::Make();
};

__device__ __forceinline__ int ProblemChunks(const GemvProblem& p) {
  return p.chunk_expert ? *p.num_chunks : (p.rows + kGemvRows - 1) / kGemvRows;
}

// The problem of work unit `r` where problem q has units[q] units, in problem order (the grouped
// kernels stride one unit index over all of them); r becomes the unit's index within it.
__device__ __forceinline__ int UnitProblem(const int (&units)[kMaxProblems], int& r) {
  int q = 0;
#pragma unroll
  for (int i = 0; i < kMaxProblems - 1; ++i) {
    if (q == i && r >= units[i]) {
      r -= units[i];
      q = i + 1;
    }
  }
  return q;
}

// Row chunk `chunk` of problem p: from its chunk arrays (an MoE layer's, built by the routing
// kernel), else the implicit chunks of `chunk_rows` rows over p.rows of expert 0.
struct RowChunk {
  int expert, row0, rows;
};
__device__ __forceinline__ RowChunk ChunkOf(const GemvProblem& p, int chunk, int chunk_rows) {
  if (p.chunk_expert) {
    const int ci = chunk + (p.chunk_base ? *p.chunk_base : 0);
    return {p.chunk_expert[ci], p.chunk_row0[ci], p.chunk_rows[ci]};
  }
  const int row0 = chunk * chunk_rows;
  return {0, row0, min(chunk_rows, p.rows - row0)};
}

__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void CpAsyncCommitGroup() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void CpAsyncWaitGroup() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// One warp's share of a work unit: `steps` k-steps of kGemvNT consecutive 16x16 tiles, the first
// at `tiles` (uint32 trellis words; the next k-step k_stride words further), times the lane's token
// row of x (fp16, global or shared memory). acc[t]: tile t: {y[2c][g], y[2c+1][g], y[2c][g+8],
// y[2c+1][g+8]} (token, column), g = lane / 4, c = lane % 4. Start() issues the first copies
// (so a caller can do other work while they fly); Run() is the k-loop.
template <int K, int CB>
struct GemvWarpSlice {
  static constexpr int kStageWords = kGemvNT * 8 * K;
  // The unit's trellis words stream through a per-warp shared-memory ring (cp.async, kStages
  // deep): a k-step's kNT tiles are contiguous (8K * kNT words), so one 16-byte copy per lane
  // (two at K > 4) fetches them, several steps ahead of the decode. The k-loop is unrolled by the
  // ring's depth, so every ring slot is a compile-time offset from `ring` and only the source
  // pointer runs (ptxas otherwise re-derived the lane's slot addresses every step under the
  // register limit).
  uint32_t* ring;
  const uint32_t* src;
  size_t k_stride;
  int steps;
  int lane;

  // Copies k-step `step`'s words into ring slot `slot` (empty group past the last step).
  template <int kSlot>
  __device__ __forceinline__ void Issue(bool valid) {
    if (valid) {
#pragma unroll
      for (int piece = lane; piece < kStageWords / 4; piece += 32)
        CpAsync16(ring + kSlot * kStageWords + 4 * piece, src + 4 * piece);
    }
    CpAsyncCommitGroup();
    src += k_stride;
  }

  // ring_base: this warp's kGemvStages * kStageWords words of shared memory.
  __device__ __forceinline__ void Start(uint32_t* ring_base, const uint32_t* tiles, size_t stride, int n_steps,
                                        int lane_id) {
    ring = ring_base;
    src = tiles;
    k_stride = stride;
    steps = n_steps;
    lane = lane_id;
    Issue<0>(0 < steps);
    Issue<1>(1 < steps);
    Issue<2>(2 < steps);
    static_assert(kGemvStages == 4, "Start issues kGemvStages - 1 steps");
  }

  // xp: the lane's token row of x at this slice's first k, plus 2c (read only when tok_ok).
  __device__ __forceinline__ void Run(const __half* xp, bool tok_ok, const LaneSlots<K>& slots, const Pow2Table& pow2,
                                      float (&acc)[kGemvNT][4]) {
#pragma unroll
    for (int t = 0; t < kGemvNT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[t][i] = 0.f;
    // MUL1: the raw operand is 1024 + byte sum; weight = scale * raw + bias, so the bias needs
    // the token sums of x over this k-slice (one extra mma per k-step with A = ones).
    float rowsum[4] = {0.f, 0.f, 0.f, 0.f};
    const uint32_t mask = 0x8fff8fffu, flip = 0x3b603b60u;
    // The lane's words of tile 0 in ring slot 0; the other tiles and slots are fixed offsets.
    const uint32_t* lane_words[LaneSlots<K>::kWords];
#pragma unroll
    for (int j = 0; j < LaneSlots<K>::kWords; ++j) lane_words[j] = ring + slots.idx[j];
    uint32_t x_next[2];
    x_next[0] = tok_ok ? *reinterpret_cast<const uint32_t*>(xp) : 0u;
    x_next[1] = tok_ok ? *reinterpret_cast<const uint32_t*>(xp + 8) : 0u;
    for (int i0 = 0; i0 < steps; i0 += kGemvStages) {
#pragma unroll
      for (int s = 0; s < kGemvStages; ++s) {
        const int i = i0 + s;
        if (i >= steps) break;
        const uint32_t x[2] = {x_next[0], x_next[1]};
        xp += 16;
        if (i + 1 < steps && tok_ok) {
          x_next[0] = *reinterpret_cast<const uint32_t*>(xp);
          x_next[1] = *reinterpret_cast<const uint32_t*>(xp + 8);
        }
        Step(s, x, lane_words, slots.shift, mask, flip, pow2, acc, rowsum);
        // Slot s was read just now; the step kGemvStages - 1 ahead goes into the slot before it.
        const bool valid = i + kGemvStages - 1 < steps;
        if (s == 0) Issue<3>(valid);
        if (s == 1) Issue<0>(valid);
        if (s == 2) Issue<1>(valid);
        if (s == 3) Issue<2>(valid);
      }
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
  }

  // One k-step from ring slot `slot` (a compile-time constant after unrolling).
  __device__ __forceinline__ static void Step(int slot, const uint32_t (&x)[2],
                                              const uint32_t* const (&lane_words)[LaneSlots<K>::kWords], int shift,
                                              uint32_t mask, uint32_t flip, const Pow2Table& pow2,
                                              float (&acc)[kGemvNT][4], float (&rowsum)[4]) {
    uint32_t even[2], odd[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      even[j] = __byte_perm(x[j], x[j], 0x1010);
      odd[j] = __byte_perm(x[j], x[j], 0x3232);
    }
    if constexpr (CB == kCbMul1) {
      const uint32_t ones[4] = {0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u};
      Mma16816(rowsum, ones, x[0], x[1]);
    }
    CpAsyncWaitGroup<kGemvStages - 2>();
    // Makes every lane's copies visible, and guarantees that every lane has finished reading
    // the slot that the issue after this step overwrites (it was read in the previous step).
    __syncwarp();
#pragma unroll
    for (int t = 0; t < kGemvNT; ++t) {
      uint32_t w[LaneSlots<K>::kWords];
#pragma unroll
      for (int j = 0; j < LaneSlots<K>::kWords; ++j) w[j] = lane_words[j][slot * kStageWords + t * 8 * K];
      uint32_t b[8];
      DecodeLaneRaw<K, CB>(w, shift, mask, flip, pow2, b);
      const uint32_t ae[4] = {b[0], b[4], b[2], b[6]};
      const uint32_t ao[4] = {b[1], b[5], b[3], b[7]};
      Mma16816(acc[t], ae, even[0], even[1]);
      Mma16816(acc[t], ao, odd[0], odd[1]);
    }
  }
};

// y[row0 + token, col0 + 16t + ...] += acc[t] (GemvWarpSlice's layout) for the chunk's `rows` tokens.
__device__ __forceinline__ void AtomicAddTiles(const float (&acc)[kGemvNT][4], float* y, int n, int row0, int rows,
                                               int col0, int lane) {
  const int g = lane >> 2, c = lane & 3;
  const int t0 = 2 * c, t1 = t0 + 1;  // token rows inside the chunk
  float* y0 = y + static_cast<size_t>(row0 + t0) * n + col0 + g;
  float* y1 = y + static_cast<size_t>(row0 + t1) * n + col0 + g;
#pragma unroll
  for (int t = 0; t < kGemvNT; ++t) {
    if (t0 < rows) {
      atomicAdd(y0 + 16 * t, acc[t][0]);
      atomicAdd(y0 + 16 * t + 8, acc[t][2]);
    }
    if (t1 < rows) {
      atomicAdd(y1 + 16 * t, acc[t][1]);
      atomicAdd(y1 + 16 * t + 8, acc[t][3]);
    }
  }
}

template <int K, int CB>
__global__ void __launch_bounds__(kGemvWarps * 32, 3) GroupedGemvKernel(const GemvBatch batch) {
  constexpr int kStageWords = GemvWarpSlice<K, CB>::kStageWords;
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
    int r = u;
    const int q = UnitProblem(units, r);
    const GemvProblem& p = batch.p[q];
    const int col_groups = p.n / (16 * kGemvNT);
    const int k_tiles = p.k / 16;
    const int k_slices = (k_tiles + p.k_tiles_per_unit - 1) / p.k_tiles_per_unit;
    const int ks = r % k_slices;
    const int cg = (r / k_slices) % col_groups;
    const int chunk = r / (k_slices * col_groups);
    const RowChunk rc = ChunkOf(p, chunk, kGemvRows);
    const int expert = rc.expert, row0 = rc.row0, rows = rc.rows;
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

    float acc[kGemvNT][4];
    GemvWarpSlice<K, CB> slice;
    slice.Start(gemv_ring + (threadIdx.x >> 5) * (kGemvStages * kStageWords), tiles, k_stride, kt1 - kt0, lane);
    slice.Run(x_row + kt0 * 16, tok_ok, slots, batch.pow2, acc);

    AtomicAddTiles(acc, p.y, p.n, row0, rows, 16 * cg * kGemvNT, lane);
  }
}

template <int K, int CB>
void LaunchGroupedGemv(const GemvBatch& batch, int grid, cudaStream_t stream) {
  LaunchPdl(GroupedGemvKernel<K, CB>, dim3(grid), dim3(kGemvWarps * 32), stream, batch);
}

}  // namespace exl3::cuda
