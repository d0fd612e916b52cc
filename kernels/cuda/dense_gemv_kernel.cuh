// One-launch EXL3 linear layer for decode-sized inputs (rows <= kGemvMaxRows, backend_internal.h):
//   y[r] = ((fp16((x[r] ⊙ suh) · H) · W_inner) · H) ⊙ svh (+ bias)
// with H the block-diagonal Hadamard-128 / sqrt(128) (transform_kernels.cuh). The input transform,
// the trellis GEMV (GemvWarpSlice, gemv_kernel.cuh) and the output transform run in one kernel, so a
// layer costs one launch instead of three (linear.cu's InputTransformKernel / OutputTransformKernel
// remain for the prefill GEMM and the reference path).
//
// Work unit (one block of kGemvWarps warps): one chunk of <= 8 rows, one column block of
// kGemvWarps x 64 columns (one 64-column group per warp) and one k-slice. The block transforms the
// x rows of the 128-blocks its k-slice touches into shared memory (fp16, the warps splitting the
// blocks), then every warp runs its column group's k-slice and adds its partial sums into the fp32
// accumulator with atomics. The block whose arrival completes a (chunk, column block) — the last of
// its k-slices — applies the output transform to it, writes y, and zeroes the accumulator and the
// arrival count again, so both workspaces are all zero between calls and nothing clears them.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/cuda/gemv_kernel.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/transform_kernels.cuh"
#include "kernels/cuda/trellis_decode.cuh"

namespace exl3::cuda {

inline constexpr int kDenseBlockCols = kGemvWarps * 16 * kGemvNT;  // columns per column block (512)
inline constexpr int kDenseMaxSliceTiles = 24;                      // k-slice length limit, 16-row tiles
// 128-blocks of k a slice of up to kDenseMaxSliceTiles tiles can touch (it may start mid-block).
inline constexpr int kDenseMaxCover = (kDenseMaxSliceTiles + 6) / 8 + 1;
// 128-block jobs per warp of the input transform (rows x covered blocks) and of the output
// transform (rows x 4 blocks of a column block), at most.
inline constexpr int kDenseJobsPerWarp = kGemvRows * kDenseMaxCover / kGemvWarps;
inline constexpr int kDenseJobBatch = 2;  // jobs whose loads are in flight together (registers)
static_assert(kDenseBlockCols / 128 <= kDenseMaxCover, "output jobs must fit kDenseJobsPerWarp");

struct DenseGemvArgs {
  const uint16_t* trellis = nullptr;  // [k/16, n/16, 16K] packed trellis words (uint16)
  const float* x = nullptr;           // [rows, k] fp32 input
  const uint16_t* suh = nullptr;      // [k] fp16 input signs/scales
  const uint16_t* svh = nullptr;      // [n] fp16 output signs/scales
  const uint16_t* bias = nullptr;     // [n] fp16, or null
  float* y = nullptr;                 // [rows, n] fp32 output (overwritten)
  float* acc = nullptr;               // [rows, n] fp32 workspace: all zero on entry, left all zero
  int* arrivals = nullptr;            // [ceil(rows/8), ceil(n/kDenseBlockCols)] int32 workspace: likewise
  int rows = 0, k = 0, n = 0;         // rows <= kGemvMaxRows; k, n multiples of 128
  int k_tiles_per_unit = 0;           // k-slice length in 16-row tiles, 1..kDenseMaxSliceTiles
  Pow2Table pow2 = Pow2Table::Make();
};

// DenseGemvArgs above gives every tensor's shape and dtype. Grid: at most the number of units
// (ceil(rows/8) * column blocks * k-slices), kGemvWarps * 32 threads per block.
template <int K, int CB>
__global__ void __launch_bounds__(kGemvWarps * 32, 3) DenseGemvKernel(const DenseGemvArgs a) {
  constexpr int kStageWords = GemvWarpSlice<K, CB>::kStageWords;
  // Row stride of the transformed x in halves: 4 words of padding put the 8 token rows that a
  // warp's lanes read at once (word offset c + stride * g) in distinct banks.
  constexpr int kXStride = kDenseMaxCover * 128 + 8;
  __shared__ __align__(16) uint32_t ring[kGemvWarps * kGemvStages * kStageWords];
  __shared__ __align__(16) __half xs[kGemvRows * kXStride];
  __shared__ int completes;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const LaneSlots<K> slots(lane);
  const int g = lane >> 2, c = lane & 3;
  const int k_tiles = a.k / 16, n_tiles = a.n / 16;
  const int col_groups = a.n / (16 * kGemvNT);
  const int col_blocks = (col_groups + kGemvWarps - 1) / kGemvWarps;
  const int k_slices = (k_tiles + a.k_tiles_per_unit - 1) / a.k_tiles_per_unit;
  const int total = (a.rows + kGemvRows - 1) / kGemvRows * col_blocks * k_slices;
  const size_t k_stride = static_cast<size_t>(n_tiles) * (8 * K);  // words per row of tiles
  bool waited = false;

  for (int u = blockIdx.x; u < total; u += gridDim.x) {
    const int ks = u % k_slices;
    const int cb = (u / k_slices) % col_blocks;
    const int chunk = u / (k_slices * col_blocks);
    const int row0 = chunk * kGemvRows, rows = min(kGemvRows, a.rows - row0);
    const int kt0 = ks * a.k_tiles_per_unit, kt1 = min(k_tiles, kt0 + a.k_tiles_per_unit);
    const int cg = cb * kGemvWarps + warp;  // this warp's 64-column group
    const bool has_cols = cg < col_groups;

    // The trellis is not written by the previous kernel of the stream: its first copies start
    // before the PDL wait, overlapping that kernel's tail.
    GemvWarpSlice<K, CB> slice;
    if (has_cols) {
      const uint32_t* tiles = reinterpret_cast<const uint32_t*>(a.trellis) +
                              (static_cast<size_t>(kt0) * n_tiles + cg * kGemvNT) * (8 * K);
      slice.Start(ring + warp * (kGemvStages * kStageWords), tiles, k_stride, kt1 - kt0, lane);
    }
    if (!waited) {
      PdlEnter();
      waited = true;
    }

    // Input transform of the 128-blocks [b0, b0 + nb) of the chunk's rows, shared by the warps
    // (job j = row * nb + block; kDenseJobBatch jobs load together, so their latencies overlap).
    const int b0 = kt0 / 8, nb = (kt1 - 1) / 8 - b0 + 1;
#pragma unroll 1
    for (int i0 = 0; i0 < kDenseJobsPerWarp; i0 += kDenseJobBatch) {
      float v[kDenseJobBatch][4];
#pragma unroll
      for (int i = 0; i < kDenseJobBatch; ++i) {
        const int j = warp + kGemvWarps * (i0 + i), r = j / nb, b = j % nb;
        if (j < rows * nb)
          InputLoad(a.x + static_cast<size_t>(row0 + r) * a.k + 128 * (b0 + b), a.suh + 128 * (b0 + b), v[i], lane);
      }
#pragma unroll
      for (int i = 0; i < kDenseJobBatch; ++i) {
        const int j = warp + kGemvWarps * (i0 + i), r = j / nb, b = j % nb;
        if (j < rows * nb) InputFinish(v[i], xs + r * kXStride + 128 * b, lane);
      }
    }
    __syncthreads();

    if (has_cols) {
      float acc[kGemvNT][4];
      const bool tok_ok = g < rows;
      slice.Run(xs + (tok_ok ? g : 0) * kXStride + 16 * (kt0 - 8 * b0) + 2 * c, tok_ok, slots, a.pow2, acc);
      AtomicAddTiles(acc, a.acc, a.n, row0, rows, 16 * kGemvNT * cg, lane);
    }

    // Arrival, ordered as a grid barrier orders it: the block barrier, then one thread's fence and
    // count. The block that completes the (chunk, column block) finishes it: per warp, up to
    // kDenseJobsPerWarp 128-blocks of y' (job j = row * nbo + block), kDenseJobBatch at a time
    // loaded (and cleared) first.
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      int* count = a.arrivals + chunk * col_blocks + cb;
      const bool last = atomicAdd(count, 1) == k_slices - 1;
      if (last) {
        *count = 0;  // every k-slice has arrived: nothing else touches it in this launch
        __threadfence();
      }
      completes = last;
    }
    __syncthreads();
    if (completes) {
      const int col0 = cb * kDenseBlockCols;
      const int nbo = min(kDenseBlockCols, a.n - col0) / 128;
#pragma unroll 1
      for (int i0 = 0; i0 < kDenseJobsPerWarp; i0 += kDenseJobBatch) {
        float v[kDenseJobBatch][4];
#pragma unroll
        for (int i = 0; i < kDenseJobBatch; ++i) {
          const int j = warp + kGemvWarps * (i0 + i), r = j / nbo, b = j % nbo;
          const size_t off = static_cast<size_t>(row0 + r) * a.n + col0 + 128 * b;
          if (j < rows * nbo) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              v[i][e] = __ldcg(a.acc + off + 32 * e + lane);
              __stcg(a.acc + off + 32 * e + lane, 0.f);
            }
          }
        }
#pragma unroll
        for (int i = 0; i < kDenseJobBatch; ++i) {
          const int j = warp + kGemvWarps * (i0 + i), r = j / nbo, b = j % nbo;
          const size_t off = static_cast<size_t>(row0 + r) * a.n + col0 + 128 * b;
          if (j < rows * nbo) {
            OutputValues(v[i], a.svh + col0 + 128 * b, a.bias ? a.bias + col0 + 128 * b : nullptr, lane);
#pragma unroll
            for (int e = 0; e < 4; ++e) a.y[off + 32 * e + lane] = v[i][e];
          }
        }
      }
    }
    // The next unit's writes of xs and `completes` come after every warp has passed the barrier
    // above, by which point this unit's reads of both are done.
  }
  if (!waited) PdlEnter();
}

template <int K, int CB>
void LaunchDenseGemv(const DenseGemvArgs& args, int grid, cudaStream_t stream) {
  LaunchPdl(DenseGemvKernel<K, CB>, dim3(grid), dim3(kGemvWarps * 32), stream, args);
}

}  // namespace exl3::cuda
