// Launch shapes of the GEMV and GEMM kernels: grids, k-slice lengths, and which GEMV a dense layer
// runs (the one-launch DenseGemvKernel or the three launches). Host code only.
#pragma once

namespace exl3::cuda {

// Rows at or below which the native path uses the 16-row GEMV rather than the prefill GEMM.
inline constexpr int kGemvMaxRows = 48;

// Picks the k-slice length for a GEMV problem so that about `target_units` warp units exist.
int GemvKTilesPerUnit(int k, int n, int chunks, int sm_count);
int GemvGrid(int sm_count);
// k-slice length (16-row tiles) of the one-launch GEMV (dense_gemv_kernel.cuh) at bit width K for
// chunks of `rows` rows (<= 8), `base_units` (row chunks x 128-column blocks) over k/16 tiles on
// sm_count SMs.
int DenseGemvSliceTiles(int K, int rows, int k_tiles, long base_units, int sm_count);
int GemmGrid(int sm_count, long units);

// The one-launch GEMV's configuration for m rows of a k x n layer of bit width K, and whether
// LinearForward runs it (rather than the three launches); the rule is written at its definition.
struct DenseGemvPlan {
  int slice_tiles = 0;
  long units = 0;
  bool one_launch = false;
};
DenseGemvPlan PlanDenseGemv(int m, int k, int n, int K, int sm_count);

}  // namespace exl3::cuda
