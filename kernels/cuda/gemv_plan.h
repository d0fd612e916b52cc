// Launch shapes of the GEMV and GEMM kernels: grids, k-slice lengths, and which GEMV a dense layer
// runs (the one-launch DenseGemvKernel or the three launches). Host code only.
#pragma once

namespace exl3::cuda {

// Which kernel the native path runs by row count. The GEMVs work in chunks of kGemvRows (8) rows,
// the prefill GEMM in chunks of kGemmBM (128) rows (gemv_kernel.cuh).
// LinearForward: m <= kLinearGemvMaxRows rows -> a GEMV (one launch or three: PlanDenseGemv),
// more -> the prefill GEMM (in k-slices at decode-sized row counts: GemmKStages). The GEMVs decode
// every weight once per 8-row chunk, the GEMM once: read from exl3-bench gemv on an H200
// (bench/results/h200.md, 2026-12-01, every path forced in the same run at seven shapes), the GEMV
// is faster at m = 16 at all seven and the k-sliced GEMM at m = 32 at six (one tie); m = 17..31 is
// unmeasured. The GEMV kernels take up to kGemvMaxRows rows (bench_hooks.h's forced paths).
inline constexpr int kLinearGemvMaxRows = 16;
inline constexpr int kGemvMaxRows = 48;
// MoeRunner: T <= kMoeGemvMaxTokens tokens -> the grouped GEMV (experts see few rows each), more
// -> the grouped GEMM.
inline constexpr int kMoeGemvMaxTokens = 64;

// Persistent grids: blocks per SM (the kernels' __launch_bounds__ minimum blocks: 3 for
// GroupedGemvKernel and DenseGemvKernel, 2 for GroupedGemmKernel).
inline constexpr int kGemvBlocksPerSm = 3;
inline constexpr int kGemmBlocksPerSm = 2;
// GEMV work units wanted per resident warp when choosing the k-slice length.
inline constexpr int kGemvUnitsPerWarp = 2;
// DequantKernel's grid (grid-stride over tiles): twice the 132 SMs of an H100/H200.
inline constexpr int kDequantGrid = 264;

// Picks the k-slice length (16-row tiles) for a GEMV problem of `chunks` row chunks so that about
// kGemvUnitsPerWarp work units exist per resident warp of the grid.
int GemvKTilesPerUnit(int k, int n, int chunks, int sm_count);
int GemvGrid(int sm_count);
// k-slice length (16-row tiles) of the one-launch GEMV (dense_gemv_kernel.cuh) at bit width K for
// chunks of `rows` rows (<= 8), `base_units` (row chunks x 128-column blocks) over k/16 tiles on
// sm_count SMs.
int DenseGemvSliceTiles(int K, int rows, int k_tiles, long base_units, int sm_count);
int GemmGrid(int sm_count, long units);
// k-slice length (stages of 64 k) of LinearForward's GEMM for m rows of a k x n layer: 0 (one unit
// per chunk and column group covers all of k) when those units fill the grid kGemmSplitWaves
// times, else the length that makes about that many units, at least kGemmMinSliceStages stages.
inline constexpr int kGemmSplitWaves = 2;
inline constexpr int kGemmMinSliceStages = 4;
int GemmKStages(int m, int k, int n, int sm_count);

// From kLinearDequantGemmMinRows rows LinearForward's native path dequantises the layer into the
// workspace (k x n fp16) and multiplies with cuBLAS instead of running the fused GEMM: on an H200
// (exl3-bench gemm, 4096x14336, bench/results/h200.md) that was 1.46x faster at m = 256 and
// 2.0-3.0x at 512..8192 (the fused mma.sync GEMM reaches ~22 % of cuBLAS fp16, while one
// dequantisation costs about as much as a GEMV); at m = 128 the two were within 8 % (136 against
// 146 us). Below it (decode batches, short chunks) the fused kernels read the trellis only.
// Forcing the GEMM (bench_hooks.h, path 3) turns it off.
inline constexpr int kLinearDequantGemmMinRows = 256;
bool UseDequantGemm(int m);

// The one-launch GEMV's configuration for m rows of a k x n layer of bit width K, and whether
// LinearForward runs it (rather than the three launches); the rule is written at its definition.
struct DenseGemvPlan {
  int slice_tiles = 0;
  long units = 0;
  bool one_launch = false;
};
DenseGemvPlan PlanDenseGemv(int m, int k, int n, int K, int sm_count);

// The GEMV path LinearForward's native path takes for m rows of a k x n layer of bit width K on
// sm_count SMs: 1 one launch, 2 three launches, 0 neither: the prefill GEMM (m > kLinearGemvMaxRows,
// or forced). Overrides (bench_hooks.h) apply.
int GemvPathFor(int m, int k, int n, int K, int sm_count);

}  // namespace exl3::cuda
