// GEMV/GEMM launch shapes and the dense GEMV path rule (gemv_plan.h), with exl3-bench's overrides
// of them (bench_hooks.h).
#include "kernels/cuda/gemv_plan.h"

#include <algorithm>
#include <atomic>

#include "kernels/cuda/bench_hooks.h"
#include "kernels/cuda/dense_gemv_kernel.cuh"
#include "kernels/cuda/gemv_kernel.cuh"

namespace exl3::cuda {

int GemvKTilesPerUnit(int k, int n, int chunks, int sm_count) {
  const int k_tiles = k / 16;
  const long col_groups = n / (16 * kGemvNT);
  const long target = static_cast<long>(sm_count) * kGemvBlocksPerSm * kGemvWarps * kGemvUnitsPerWarp;
  long slices = target / std::max<long>(1, chunks * col_groups);
  slices = std::clamp<long>(slices, 1, std::max(1, k_tiles / 4));
  return static_cast<int>((k_tiles + slices - 1) / slices);
}
int GemvGrid(int sm_count) { return sm_count * kGemvBlocksPerSm; }

namespace {
std::atomic<int> g_dense_slice_override{0};
std::atomic<int> g_gemv_path_override{0};
}  // namespace
void SetDenseGemvSliceOverride(int tiles) { g_dense_slice_override.store(tiles); }
void SetGemvPathOverride(int path) { g_gemv_path_override.store(path); }

// Cost models, in warp k-steps, fitted to exl3-bench's k-slice sweep on an H200 (bench/results/h200.md,
// m = 1 and 8). A unit costs its slice plus about 3 k-steps (x transform, barriers, partial sums,
// atomics, arrival). With one or two rows an SM decodes about as fast with one block (8 warps) as
// with three, so a layer costs the most units any SM runs times that (plus about 3 per extra round
// of the persistent grid); with more rows the per-unit chain is longer and three blocks per SM hide
// it, so a layer costs the waves of three blocks per SM. Ties go to the longer slice (fewer partial
// sums per output).
int DenseGemvSliceTiles(int K, int rows, int k_tiles, long base_units, int sm_count) {
  const int most = std::min(k_tiles, DenseMaxSliceTiles(K));
  const int forced = g_dense_slice_override.load();
  if (forced > 0) return std::min(forced, most);
  const long grid = GemvGrid(sm_count);
  // Work that fills every block slot even at the longest slice takes it: the sweep's best (or
  // within 2 %) at all large shapes, where the models below rank the neighbours poorly.
  const auto units_at = [&](int t) { return base_units * ((k_tiles + kDenseWarpsK * t - 1) / (kDenseWarpsK * t)); };
  if (units_at(most) >= grid) return most;
  int best = 1;
  long best_cost = -1;
  // The lengths exl3-bench sweeps (1 for tiny k); 14 was slower than both 12 and 16 at every large
  // shape of the sweep (not understood), 5, 7, 9, 11, 13 and 15 are unmeasured.
  for (int t : {1, 2, 3, 4, 6, 8, 10, 12, 16}) {
    if (t > most) break;
    const long units = units_at(t);
    const long rounds = (units + grid - 1) / grid;
    const long per_sm = (units + sm_count - 1) / sm_count;
    const long cost = rows <= 2 ? per_sm * (t + 3) + 3 * (rounds - 1) : (per_sm + 2) / 3 * (t + 3);
    if (best_cost < 0 || cost <= best_cost) {
      best = t;
      best_cost = cost;
    }
  }
  return best;
}
// Which GEMV LinearForward runs for m <= kLinearGemvMaxRows rows (native path): the one-launch
// DenseGemvKernel or the three launches (input transform, GroupedGemvKernel, output transform).
// Read from exl3-bench gemv on an H200 (bench/results/h200.md, 2026-12-01, both paths forced in the
// same run; m = 1, 2, 4, 8, 16, 32 at seven shapes), in terms of the one-launch configuration that
// DenseGemvSliceTiles picks (slice t, units = row chunks x 128-column blocks x k-ranges):
// - units <= SMs (one unit per SM: a latency chain): the one launch wins, 18-28 % (it saves two
//   launches and the round trip of y through memory);
// - t shorter than the longest slice (the cost model spread the work over more block slots): the
//   one launch wins (0.70-0.98 of the three launches' time) or ties (1.01) in every measured case;
// - otherwise, the longest slice with more units than SMs, the SMs run several of the longest
//   units each: with up to kDenseGemvFullMachineMaxRows rows and every block slot filled (units >=
//   the grid of 3 blocks per SM: 4096x14336 and 14336x4096 at m = 1, 2) the one launch still wins
//   or ties (0.94-1.01); with more rows (m = 4-32 at those shapes,
//   5120x5120 at m = 16, 32, 5120x2304 and 4096x4096 at m = 32: 1.01-1.38) or with units between the
//   SM count and the grid (5120x5120 at m = 1, 2: 200 units on 132 SMs, 1.17-1.23) the three launches
//   win. Why the longest units lose there is not measured apart (per unit: the x transform of 8 rows
//   x 1024 k, shared-memory partial sums, atomics, arrival).
// Unmeasured: K >= 7 (longest slice 8), other SM counts. A forced k-slice (SetDenseGemvSliceOverride)
// or path (SetGemvPathOverride) overrides the rule.
inline constexpr int kDenseGemvFullMachineMaxRows = 2;

DenseGemvPlan PlanDenseGemv(int m, int k, int n, int K, int sm_count) {
  const int chunks = (m + kGemvRows - 1) / kGemvRows;
  const long base_units = static_cast<long>(chunks) * (n / kDenseBlockCols);
  const int k_tiles = k / 16;
  DenseGemvPlan p;
  p.slice_tiles = DenseGemvSliceTiles(K, std::min(m, kGemvRows), k_tiles, base_units, sm_count);
  const int range = kDenseWarpsK * p.slice_tiles;
  p.units = base_units * ((k_tiles + range - 1) / range);
  const int longest = std::min(k_tiles, DenseMaxSliceTiles(K));
  const int forced = g_gemv_path_override.load();
  if (forced == 1 || forced == 2) {
    p.one_launch = forced == 1;
  } else if (g_dense_slice_override.load() > 0) {
    p.one_launch = true;
  } else {
    p.one_launch = p.slice_tiles < longest || p.units <= sm_count ||
                   (m <= kDenseGemvFullMachineMaxRows && p.units >= GemvGrid(sm_count));
  }
  return p;
}

int GemvPathFor(int m, int k, int n, int K, int sm_count) {
  const int forced = g_gemv_path_override.load();
  if (forced == 3 || m > kGemvMaxRows) return 0;
  if (forced == 1 || forced == 2) return forced;
  if (m > kLinearGemvMaxRows) return 0;
  return PlanDenseGemv(m, k, n, K, sm_count).one_launch ? 1 : 2;
}

bool UseDequantGemm(int m) { return m >= kLinearDequantGemmMinRows && g_gemv_path_override.load() != 3; }

int GemmKStages(int m, int k, int n, int sm_count) {
  const long base_units = static_cast<long>((m + kGemmBM - 1) / kGemmBM) * (n / 128);
  const long target = static_cast<long>(kGemmSplitWaves) * sm_count * kGemmBlocksPerSm;
  const int stages = k / kGemmStageK;
  const long slices = std::min<long>((target + base_units - 1) / base_units, stages / kGemmMinSliceStages);
  if (slices <= 1) return 0;
  return static_cast<int>((stages + slices - 1) / slices);
}

int GemmGrid(int sm_count, long units) {
  return static_cast<int>(std::min<long>(units, static_cast<long>(sm_count) * kGemmBlocksPerSm));
}

}  // namespace exl3::cuda
