// One-launch EXL3 linear layers for decode-sized inputs (rows <= kGemvMaxRows, gemv_plan.h): for
// each of up to kMaxProblems layers of one input x (an attention layer's q, k and v),
//   y_i[r] = ((fp16((x[r] ⊙ suh_i) · H) · W_i) · H) ⊙ svh_i (+ bias_i)
// with H the block-diagonal Hadamard-128 / sqrt(128) (transform_kernels.cuh). The input transforms,
// the trellis GEMVs (GemvWarpSlice, gemv_kernel.cuh) and the output transforms run in one kernel, so
// the layers cost one launch instead of three (linear_kernels.cu's InputTransformKernel /
// OutputTransformKernel remain for the prefill GEMM and the reference path).
//
// Work unit (one block of kGemvWarps = 8 warps): one layer, one chunk of <= 8 rows, one 128-column
// block (one output Hadamard block: two 64-column groups) and a k-range of kDenseWarpsK k-slices;
// the layers' units follow one another (layer 0's first). The block transforms the x rows of the
// 128-blocks its k-range touches into shared memory (fp16, with its layer's suh; the warps
// splitting the blocks); warp w runs column group w % 2 over k-slice w / 2; the four partial sums
// of a column group are added in shared memory, and one warp per column group adds the result into
// the layer's fp32 accumulator with atomics (a quarter of the atomics, and of the partial sums per
// output, that one k-slice per atomic add would cost). The block whose arrival completes a (chunk,
// column block) — the last of its k-ranges — applies the output transform to it, writes y, and
// zeroes the accumulator and the arrival count again, so both workspaces are all zero between
// calls and nothing clears them.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/cuda/gemv_kernel.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/transform_kernels.cuh"
#include "kernels/cuda/trellis_decode.cuh"

namespace exl3::cuda {

inline constexpr int kDenseWarpsK = 4;  // k-slices per work unit (warps per column group)
inline constexpr int kDenseWarpsN = kGemvWarps / kDenseWarpsK;  // 64-column groups per unit
inline constexpr int kDenseBlockCols = kDenseWarpsN * 16 * kGemvNT;  // columns per unit (128)
static_assert(kDenseBlockCols == 128, "a unit's columns are one output Hadamard block");

// k-slice length limit (16-row tiles) for bit width K: a unit's k-range (kDenseWarpsK slices) and
// its transformed x must fit the 48 KB of static shared memory beside the cp.async ring.
__host__ __device__ constexpr int DenseMaxSliceTiles(int K) { return K >= 7 ? 8 : 16; }
// 128-blocks of k that a unit's k-range can touch (it may start mid-block).
__host__ __device__ constexpr int DenseMaxCover(int K) { return (kDenseWarpsK * DenseMaxSliceTiles(K) + 6) / 8 + 1; }

// One layer of a DenseGemvArgs.
struct DenseGemvLayer {
  const uint16_t* trellis = nullptr;  // [k/16, n/16, 16K] packed trellis words (uint16)
  const uint16_t* suh = nullptr;      // [k] fp16 input signs/scales
  const uint16_t* svh = nullptr;      // [n] fp16 output signs/scales
  const uint16_t* bias = nullptr;     // [n] fp16, or null
  float* y = nullptr;                 // [rows, n] fp32 output (overwritten)
  float* acc = nullptr;               // [rows, n] fp32 workspace: all zero on entry, left all zero
  int* arrivals = nullptr;            // [ceil(rows/8), n/128] int32 workspace: likewise
  int n = 0;                          // a multiple of 128
};

struct DenseGemvArgs {
  DenseGemvLayer layer[kMaxProblems];  // the first `layers`; the same K and codebook
  int layers = 0;                      // 1..kMaxProblems
  const float* x = nullptr;            // [rows, k] fp32 input, shared by the layers
  int rows = 0, k = 0;                 // rows <= kGemvMaxRows; k a multiple of 128
  int k_slice_tiles = 0;               // k-slice length in 16-row tiles, 1..DenseMaxSliceTiles(K)
  Pow2Table pow2 = Pow2Table::Make();
};

// DenseGemvArgs above gives every tensor's shape and dtype. Grid: at most the number of units
// (ceil(rows/8) * (sum of the layers' n)/128 * ceil(k/16 / (kDenseWarpsK * k_slice_tiles))),
// kGemvWarps * 32 threads.
template <int K, int CB>
__global__ void __launch_bounds__(kGemvWarps * 32, 3) DenseGemvKernel(const DenseGemvArgs a) {
  constexpr int kStageWords = GemvWarpSlice<K, CB>::kStageWords;
  // Row stride of the transformed x in halves: 4 words of padding put the 8 token rows that a
  // warp's lanes read at once (word offset c + stride * g) in distinct banks.
  constexpr int kXStride = DenseMaxCover(K) * 128 + 8;
  // After the k-loop the same shared memory holds the partial sums of the warps of k-slices
  // 1..3: [slot][16 values][32 lanes] fp32 (lane-minor: no bank conflicts).
  constexpr int kPartialFloats = (kDenseWarpsK - 1) * kDenseWarpsN * 16 * 32;
  constexpr int kXWords = (kGemvRows * kXStride) / 2;
  __shared__ __align__(16) uint32_t ring[kGemvWarps * kGemvStages * kStageWords];
  __shared__ __align__(16) uint32_t scratch[kXWords > kPartialFloats ? kXWords : kPartialFloats];
  __shared__ int completes;
  __half* const xs = reinterpret_cast<__half*>(scratch);
  float* const partial = reinterpret_cast<float*>(scratch);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wn = warp % kDenseWarpsN, wk = warp / kDenseWarpsN;  // column group, k-slice
  const LaneSlots<K> slots(lane);
  const int g = lane >> 2, c = lane & 3;
  const int k_tiles = a.k / 16;
  const int chunks = (a.rows + kGemvRows - 1) / kGemvRows;
  const int range_tiles = kDenseWarpsK * a.k_slice_tiles;
  const int k_ranges = (k_tiles + range_tiles - 1) / range_tiles;
  // Units per layer, computed the same way by every block.
  int units[kMaxProblems];
  int total = 0;
#pragma unroll
  for (int q = 0; q < kMaxProblems; ++q) {
    units[q] = q < a.layers ? chunks * (a.layer[q].n / kDenseBlockCols) * k_ranges : 0;
    total += units[q];
  }
  bool waited = false;

  for (int u = blockIdx.x; u < total; u += gridDim.x) {
    // The unit's layer (its fields read from the parameter bank where used, as GroupedGemvKernel
    // reads its problem's).
    int r = u;
    const DenseGemvLayer& L = a.layer[UnitProblem(units, r)];
    const int n_tiles = L.n / 16, col_blocks = L.n / kDenseBlockCols;
    const size_t k_stride = static_cast<size_t>(n_tiles) * (8 * K);  // words per row of tiles
    const int kr = r % k_ranges;
    const int cb = (r / k_ranges) % col_blocks;
    const int chunk = r / (k_ranges * col_blocks);
    const int row0 = chunk * kGemvRows, rows = min(kGemvRows, a.rows - row0);
    const int kt0 = kr * range_tiles, kt1 = min(k_tiles, kt0 + range_tiles);   // the unit's k-range
    const int ks0 = min(kt1, kt0 + wk * a.k_slice_tiles);                      // this warp's k-slice
    const int ks1 = min(kt1, ks0 + a.k_slice_tiles);
    const int cg = cb * kDenseWarpsN + wn;                                     // its 64-column group

    // The trellis is not written by the previous kernel of the stream: its first copies start
    // before the PDL wait, overlapping that kernel's tail.
    GemvWarpSlice<K, CB> slice;
    slice.Start(
        ring + warp * (kGemvStages * kStageWords),
        reinterpret_cast<const uint32_t*>(L.trellis) + (static_cast<size_t>(ks0) * n_tiles + cg * kGemvNT) * (8 * K),
        k_stride, ks1 - ks0, lane);
    if (!waited) {
      PdlEnter();
      waited = true;
    }

    // Input transform of the 128-blocks [b0, b0 + nb) of the chunk's rows, shared by the warps
    // (job j = row * nb + block; two jobs per warp load together, so their latencies overlap).
    const int b0 = kt0 / 8, nb = (kt1 - 1) / 8 - b0 + 1;
    for (int j0 = warp; j0 < rows * nb; j0 += 2 * kGemvWarps) {
      const int j1 = j0 + kGemvWarps;
      float v0[4], v1[4];
      InputLoad(a.x + static_cast<size_t>(row0 + j0 / nb) * a.k + 128 * (b0 + j0 % nb), L.suh + 128 * (b0 + j0 % nb),
                v0, lane);
      if (j1 < rows * nb)
        InputLoad(a.x + static_cast<size_t>(row0 + j1 / nb) * a.k + 128 * (b0 + j1 % nb), L.suh + 128 * (b0 + j1 % nb),
                  v1, lane);
      InputFinish(v0, xs + (j0 / nb) * kXStride + 128 * (j0 % nb), lane);
      if (j1 < rows * nb) InputFinish(v1, xs + (j1 / nb) * kXStride + 128 * (j1 % nb), lane);
    }
    __syncthreads();

    float acc[kGemvNT][4];
    const bool tok_ok = g < rows && ks1 > ks0;  // a k-range's last slices may be empty
    slice.Run(xs + (tok_ok ? g : 0) * kXStride + 16 * (ks0 - 8 * b0) + 2 * c, tok_ok, slots, a.pow2, acc);
    __syncthreads();  // every warp is done with xs: it now holds the partial sums

    // k-slices 1..3 hand their sums to k-slice 0's warp of the same column group, which adds the
    // total into the accumulator.
    if (wk > 0) {
      float* slot = partial + ((wk - 1) * kDenseWarpsN + wn) * (16 * 32) + lane;
#pragma unroll
      for (int t = 0; t < kGemvNT; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) slot[(4 * t + i) * 32] = acc[t][i];
    }
    __syncthreads();
    if (wk == 0) {
#pragma unroll
      for (int s = 1; s < kDenseWarpsK; ++s) {
        const float* slot = partial + ((s - 1) * kDenseWarpsN + wn) * (16 * 32) + lane;
#pragma unroll
        for (int t = 0; t < kGemvNT; ++t)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[t][i] += slot[(4 * t + i) * 32];
      }
      AtomicAddTiles(acc, L.acc, L.n, row0, rows, 16 * kGemvNT * cg, lane);
      __threadfence();  // the atomics, before this block's arrival
    }

    // Arrival. The block that completes the (chunk, column block) finishes it: warp r the
    // 128-block of row r.
    __syncthreads();
    if (threadIdx.x == 0) {
      int* count = L.arrivals + chunk * col_blocks + cb;
      const bool last = atomicAdd(count, 1) == k_ranges - 1;
      if (last) *count = 0;  // every k-range has arrived: nothing else touches it in this launch
      completes = last;
    }
    __syncthreads();
    if (completes && warp < rows) {
      __threadfence();
      const int col0 = cb * kDenseBlockCols;
      const size_t off = static_cast<size_t>(row0 + warp) * L.n + col0;
      float v[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        v[e] = __ldcg(L.acc + off + 32 * e + lane);
        __stcg(L.acc + off + 32 * e + lane, 0.f);
      }
      OutputValues(v, L.svh + col0, L.bias ? L.bias + col0 : nullptr, lane);
#pragma unroll
      for (int e = 0; e < 4; ++e) L.y[off + 32 * e + lane] = v[e];
    }
    // The next unit writes xs only after every warp has passed the barrier above (this unit's
    // reads of the partial sums are done), and `completes` only after the next arrival barrier.
  }
  if (!waited) PdlEnter();
}

template <int K, int CB>
void LaunchDenseGemv(const DenseGemvArgs& args, int grid, cudaStream_t stream) {
  LaunchPdl(DenseGemvKernel<K, CB>, dim3(grid), dim3(kGemvWarps * 32), stream, args);
}

}  // namespace exl3::cuda
