// The MoE layer's decode in one cooperative launch (moe_cooperative.h). One persistent grid of
// MoeCoopBlocksPerSm() blocks per SM, all resident (cooperative launch), runs five phases
// separated by grid-wide barriers (cooperative_groups grid sync: a fence and a barrier, so the
// writes of one phase are visible to every block in the next):
//   0. routing (every block, in shared memory; no barrier needed) and, per (row, 128-block of
//      hidden), x ⊙ suh · H -> fp16 A of gate and up (routed slots and shared-expert rows),
//      zeroing of the accumulators and the shared expert's output scale
//   1. gate+up: GEMV work units of every chosen expert's chunks and the shared expert's rows
//   2. per (row, 128-block of the intermediate): output transforms, SwiGLU (+clamp), down's input
//      transform -> fp16 A
//   3. down: as 1
//   4. per (token, 128-block of hidden): out = sum_k w * ((y · H) ⊙ svh + bias) + shared
// Phases 0, 2 and 4 are the chain's MoeInputKernel, MoeMidKernel and MoeCombineKernel
// (moe_kernels.cu) over the block's own routing tables; 1 and 3 are GroupedGemvKernel's work
// units (gemv_kernel.cuh: a warp decodes a k-slice of 64 columns for a chunk of <= 8 rows of one
// expert and adds into y with atomics), spread over every warp of the grid, so that each SM
// streams weights in both. The decoder is picked per unit from the expert's (K, codebook)
// (ProjTable::code), so a mixed layer's classes share the phase.
#include "kernels/cuda/moe_cooperative.h"

#include <cooperative_groups.h>

#include <cstdint>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/gemv_kernel.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/moe_activation.cuh"
#include "kernels/cuda/transform_kernels.cuh"
#include "kernels/cuda/trellis_decode.cuh"

namespace exl3::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kWarps = kMoeCoopThreads / 32;
static_assert(kWarps == kGemvWarps, "the GEMV units' ring is sized per warp as in GroupedGemvKernel");
constexpr int kMaxStageWords = kGemvNT * 8 * 8;  // GemvWarpSlice<8, *>::kStageWords
// GEMV work units wanted per warp of the grid when choosing a phase's k-slice length (as the
// chain's GemvKTilesPerUnit, gemv_plan.cu).
constexpr int kUnitsPerWarp = 2;

// The powers of two the decoder multiplies by (trellis_decode.cuh DecodeLaneRaw): from constant
// memory, as the GEMV kernels take them from their launch parameters, so that the shifts stay on
// the IMAD pipe.
__constant__ Pow2Table kPow2 = {{1u, 2u, 4u, 8u, 16u, 32u, 64u, 128u, 256u, 512u, 1024u, 2048u, 4096u, 8192u,
                                 16384u, 32768u, 65536u}};

// The block's routing: the T * top_k assignments grouped by expert into slots (experts in order
// of their first assignment, each expert's slots in assignment order) and row chunks of <= 8
// slots of one expert. Every block computes the same tables from the same ids.
struct Routing {
  int slot_token[kMoeCoopMaxAssign];
  int slot_expert[kMoeCoopMaxAssign];
  float slot_weight[kMoeCoopMaxAssign];
  int assign_slot[kMoeCoopMaxAssign];  // -1: skipped
  int chunk_expert[kMoeCoopMaxAssign];
  int chunk_row0[kMoeCoopMaxAssign];
  int chunk_rows[kMoeCoopMaxAssign];
  int id[kMoeCoopMaxAssign];           // scratch: the assignment's expert, -1 if skipped
  int leader_base[kMoeCoopMaxAssign];  // scratch: (chunk base << 16) | slot base of a first assignment
  int warp_total[kWarps];
  int num_slots, num_chunks;
};

__device__ void RouteBlock(const MoeCoopArgs& a, Routing& r) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int n = a.d.T * a.d.topk;
  int e = -1;
  if (tid < n) {
    const int id = a.ids[tid];
    if (id >= 0 && id < a.num_experts && a.gate.trellis[id] != nullptr) e = id;
  }
  r.id[tid] = e;
  __syncthreads();
  // rank: earlier assignments of the same expert; leader: the first of them.
  int rank = 0, count = 0, leader = tid;
  if (e >= 0) {
    for (int j = 0; j < n; ++j) {
      const bool same = r.id[j] == e;
      if (same && j < tid) {
        if (rank == 0) leader = j;
        ++rank;
      }
      count += same ? 1 : 0;
    }
  }
  const bool lead = e >= 0 && rank == 0;
  const int chunks = lead ? (count + kGemvRows - 1) / kGemvRows : 0;
  // Exclusive block scan of (chunks << 16) | slots over the leaders (both <= 256).
  const int v = lead ? (chunks << 16) | count : 0;
  int incl = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int t = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += t;
  }
  if (lane == 31) r.warp_total[warp] = incl;
  __syncthreads();
  int before = 0;
  for (int w = 0; w < warp; ++w) before += r.warp_total[w];
  const int excl = before + incl - v;
  if (tid == kMoeCoopThreads - 1) {
    r.num_slots = (excl + v) & 0xffff;
    r.num_chunks = (excl + v) >> 16;
  }
  if (lead) {
    r.leader_base[tid] = excl;
    const int row0 = excl & 0xffff, ch0 = excl >> 16;
    for (int j = 0; j < chunks; ++j) {
      r.chunk_expert[ch0 + j] = e;
      r.chunk_row0[ch0 + j] = row0 + j * kGemvRows;
      r.chunk_rows[ch0 + j] = min(kGemvRows, count - j * kGemvRows);
    }
  }
  __syncthreads();
  if (tid < n) {
    int slot = -1;
    if (e >= 0) {
      slot = (r.leader_base[leader] & 0xffff) + rank;
      r.slot_token[slot] = tid / a.d.topk;
      r.slot_expert[slot] = e;
      r.slot_weight[slot] = a.weights[tid];
    }
    r.assign_slot[tid] = slot;
  }
  __syncthreads();
}

// Phase 0, one warp per (row, 128-block of hidden): rows [0, slots) routed, then T shared-expert
// rows (MoeInputKernel's work).
__device__ void InputPhase(const MoeCoopArgs& a, const Routing& r, int warp_global, int total_warps, int lane) {
  const MoeDims& d = a.d;
  const MoeBuffers& b = a.b;
  const int per_row = d.hidden / 128;
  const int rows_all = r.num_slots + (d.with_shared ? d.T : 0);
  for (int w = warp_global; w < rows_all * per_row; w += total_warps) {
    const int row_all = w / per_row, blk = w % per_row;
    const bool routed = row_all < r.num_slots;
    int token, row, n_inter;
    const uint16_t *suh_g, *suh_u;
    __half *ag, *au;
    float *yg, *yu, *yd;
    if (routed) {
      row = row_all;
      token = r.slot_token[row];
      const int e = r.slot_expert[row];
      suh_g = a.gate.suh[e];
      suh_u = a.up.suh[e];
      ag = b.a_gate; au = b.a_up; yg = b.y_gate; yu = b.y_up; yd = b.y_down;
      n_inter = d.inter;
    } else {
      row = token = row_all - r.num_slots;
      suh_g = a.sgate.suh[0];
      suh_u = a.sup.suh[0];
      ag = b.sa_gate; au = b.sa_up; yg = b.sy_gate; yu = b.sy_up; yd = b.sy_down;
      n_inter = d.shared_inter;
    }
    const float* xr = a.x + static_cast<size_t>(token) * d.hidden;
    InputBlock(xr + 128 * blk, suh_g + 128 * blk, ag + static_cast<size_t>(row) * d.hidden + 128 * blk, lane);
    InputBlock(xr + 128 * blk, suh_u + 128 * blk, au + static_cast<size_t>(row) * d.hidden + 128 * blk, lane);
    const int share = (n_inter + per_row - 1) / per_row;
    for (int i = blk * share + lane; i < min(n_inter, (blk + 1) * share); i += 32) {
      yg[static_cast<size_t>(row) * n_inter + i] = 0.f;
      yu[static_cast<size_t>(row) * n_inter + i] = 0.f;
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) yd[static_cast<size_t>(row) * d.hidden + 128 * blk + 32 * q + lane] = 0.f;
    if (!routed && blk == 0) {
      // The shared expert's output scale: sigmoid(x · shared_gate) (Qwen3-Next) or 1.
      float s = 0.f;
      if (a.shared_gate_vec) {
        for (int i = lane; i < d.hidden; i += 32) s += xr[i] * a.shared_gate_vec[i];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) b.shared_scale[token] = 1.f / (1.f + expf(-s));
      } else if (lane == 0) {
        b.shared_scale[token] = 1.f;
      }
    }
  }
}

// One projection of a GEMV phase: the routed experts' chunks (routing tables) or the shared
// expert's T rows in implicit chunks of 8.
struct CoopProjection {
  const ProjTable* table = nullptr;
  bool routed = false;
  const __half* a = nullptr;  // [rows, k] fp16
  float* y = nullptr;         // [rows, n] fp32, accumulated
  int k = 0, n = 0;
};

// A warp's work unit, decoded by RunUnit<K, CB>.
struct UnitWork {
  const uint32_t* tiles;  // the unit's first k-step of kGemvNT tiles
  size_t k_stride;        // words per row of tiles
  int steps;              // k-steps (16-row tiles)
  const __half* x_row;    // the lane's token row of A at the slice's first k, plus 2c
  bool tok_ok;
  float* y;
  int n, row0, rows, col0;
};

// Not inlined: the 24 decoders are compiled once each, and the phase loop around them once.
template <int K, int CB>
__device__ __noinline__ void RunUnit(UnitWork u, uint32_t* ring, int lane) {
  const LaneSlots<K> slots(lane);
  float acc[kGemvNT][4];
  GemvWarpSlice<K, CB> slice;
  slice.Start(ring, u.tiles, u.k_stride, u.steps, lane);
  slice.Run(u.x_row, u.tok_ok, slots, kPow2, acc);
  AtomicAddTiles(acc, u.y, u.n, u.row0, u.rows, u.col0, lane);
}

template <int Code = 0>
__device__ __forceinline__ void RunUnitOfCode(int code, const UnitWork& u, uint32_t* ring, int lane) {
  if constexpr (Code < kMoeSpecCodes) {
    if (code == Code) {
      RunUnit<Code / 3 + 1, Code % 3>(u, ring, lane);
    } else {
      RunUnitOfCode<Code + 1>(code, u, ring, lane);
    }
  }
}

// Phases 1 and 3: the units of `count` projections (chunks x 64-column groups x k-slices),
// strided over every warp of the grid. The k-slice count is chosen for the phase's total so that
// about kUnitsPerWarp units exist per warp (at least 4 tiles a slice).
__device__ void GemvPhase(const CoopProjection* proj, int count, const MoeCoopArgs& a, const Routing& r,
                          uint32_t* ring, int warp_global, int total_warps, int lane) {
  constexpr int kMaxProj = 4;
  int chunks[kMaxProj], col_groups[kMaxProj], k_tiles[kMaxProj], slice_tiles[kMaxProj], units[kMaxProj];
  long base_units = 0;
  int min_k_tiles = 1 << 30;
#pragma unroll
  for (int q = 0; q < kMaxProj; ++q) {
    if (q >= count) break;
    chunks[q] = proj[q].routed ? r.num_chunks : (a.d.T + kGemvRows - 1) / kGemvRows;
    col_groups[q] = proj[q].n / (16 * kGemvNT);
    k_tiles[q] = proj[q].k / 16;
    base_units += static_cast<long>(chunks[q]) * col_groups[q];
    min_k_tiles = min(min_k_tiles, k_tiles[q]);
  }
  long slices = static_cast<long>(total_warps) * kUnitsPerWarp / max(1L, base_units);
  slices = max(1L, min(slices, static_cast<long>(max(1, min_k_tiles / 4))));
  int total = 0;
#pragma unroll
  for (int q = 0; q < kMaxProj; ++q) {
    units[q] = 0;
    if (q >= count) continue;
    slice_tiles[q] = static_cast<int>((k_tiles[q] + slices - 1) / slices);
    const int k_slices = (k_tiles[q] + slice_tiles[q] - 1) / slice_tiles[q];
    units[q] = chunks[q] * col_groups[q] * k_slices;
    total += units[q];
  }
  const int g = lane >> 2, c = lane & 3;
  for (int u = warp_global; u < total; u += total_warps) {
    int q = 0, rest = u;
#pragma unroll
    for (int i = 0; i < kMaxProj - 1; ++i) {
      if (q == i && rest >= units[i]) {
        rest -= units[i];
        q = i + 1;
      }
    }
    const CoopProjection& p = proj[q];
    const int k_slices = (k_tiles[q] + slice_tiles[q] - 1) / slice_tiles[q];
    const int ks = rest % k_slices;
    const int cgroup = (rest / k_slices) % col_groups[q];
    const int chunk = rest / (k_slices * col_groups[q]);
    int expert, row0, rows;
    if (p.routed) {
      expert = r.chunk_expert[chunk];
      row0 = r.chunk_row0[chunk];
      rows = r.chunk_rows[chunk];
    } else {
      expert = 0;
      row0 = chunk * kGemvRows;
      rows = min(kGemvRows, a.d.T - row0);
    }
    const int code = p.table->code[expert];
    const int K = code / 3 + 1;
    const int kt0 = ks * slice_tiles[q];
    const int kt1 = min(k_tiles[q], kt0 + slice_tiles[q]);
    const int n_tiles = p.n / 16;
    UnitWork w;
    w.tiles = reinterpret_cast<const uint32_t*>(p.table->trellis[expert]) +
              (static_cast<size_t>(kt0) * n_tiles + cgroup * kGemvNT) * (8 * K);
    w.k_stride = static_cast<size_t>(n_tiles) * (8 * K);
    w.steps = kt1 - kt0;
    w.tok_ok = g < rows;
    w.x_row = p.a + static_cast<size_t>(row0 + (w.tok_ok ? g : 0)) * p.k + 2 * c + kt0 * 16;
    w.y = p.y;
    w.n = p.n;
    w.row0 = row0;
    w.rows = rows;
    w.col0 = 16 * cgroup * kGemvNT;
    RunUnitOfCode(code, w, ring, lane);
  }
}

// Phase 2, one warp per (row, 128-block of the intermediate) (MoeMidKernel's work).
__device__ void MidPhase(const MoeCoopArgs& a, const Routing& r, int warp_global, int total_warps, int lane) {
  const MoeDims& d = a.d;
  const MoeBuffers& b = a.b;
  const int per_row = max(d.inter, d.shared_inter) / 128;
  const int rows_all = r.num_slots + (d.with_shared ? d.T : 0);
  for (int w = warp_global; w < rows_all * per_row; w += total_warps) {
    const int row_all = w / per_row, blk = w % per_row;
    int row, e, n_inter;
    float limit;
    const ProjTable *G, *U, *D;
    const float *yg, *yu;
    __half* ad;
    if (row_all < r.num_slots) {
      row = row_all;
      e = r.slot_expert[row];
      G = &a.gate; U = &a.up; D = &a.down;
      yg = b.y_gate; yu = b.y_up; ad = b.a_down;
      n_inter = d.inter;
      limit = d.limit;
    } else {
      row = row_all - r.num_slots;
      e = 0;
      G = &a.sgate; U = &a.sup; D = &a.sdown;
      yg = b.sy_gate; yu = b.sy_up; ad = b.sa_down;
      n_inter = d.shared_inter;
      limit = d.shared_limit;
    }
    if (blk >= n_inter / 128) continue;
    const uint16_t* bias_g = G->bias[e];
    const uint16_t* bias_u = U->bias[e];
    const size_t off = static_cast<size_t>(row) * n_inter + 128 * blk;
    ActivateBlock(yg + off, yu + off, G->svh[e] + 128 * blk, bias_g ? bias_g + 128 * blk : nullptr,
                  U->svh[e] + 128 * blk, bias_u ? bias_u + 128 * blk : nullptr, D->suh[e] + 128 * blk, limit,
                  ad + off, lane);
  }
}

// Phase 4, one warp per (token, 128-block of hidden) (MoeCombineKernel's work, the same order of
// summation: the token's assignments in order, then the shared expert).
__device__ void CombinePhase(const MoeCoopArgs& a, const Routing& r, int warp_global, int total_warps, int lane) {
  const MoeDims& d = a.d;
  const int per_row = d.hidden / 128;
  for (int w = warp_global; w < d.T * per_row; w += total_warps) {
    const int t = w / per_row, blk = w % per_row;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int k = 0; k < d.topk; ++k) {
      const int slot = r.assign_slot[t * d.topk + k];
      if (slot < 0) continue;
      const int e = r.slot_expert[slot];
      const float wt = r.slot_weight[slot];
      const uint16_t* bias = a.down.bias[e];
      float v[4];
      OutputBlock(a.b.y_down + static_cast<size_t>(slot) * d.hidden + 128 * blk, a.down.svh[e] + 128 * blk,
                  bias ? bias + 128 * blk : nullptr, v, lane);
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[q] += wt * v[q];
    }
    if (d.with_shared) {
      const uint16_t* bias = a.sdown.bias[0];
      float v[4];
      OutputBlock(a.b.sy_down + static_cast<size_t>(t) * d.hidden + 128 * blk, a.sdown.svh[0] + 128 * blk,
                  bias ? bias + 128 * blk : nullptr, v, lane);
      const float sc = a.b.shared_scale[t];
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[q] += sc * v[q];
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) a.out[static_cast<size_t>(t) * d.hidden + 128 * blk + 32 * q + lane] = acc[q];
  }
}

// Two blocks per SM (16 warps; the GEMV kernels run 24): at three (80 registers) ptxas spilled
// 704 bytes in the kernel and up to 120 bytes in the K = 7, 8 MUL1 units (sm_90); at two it takes
// 125 registers and spills nothing. The ring (32 KB, sized for K = 8) and the routing tables
// (9 KB) would fit three times.
constexpr int kMinBlocksPerSm = 2;

__global__ void __launch_bounds__(kMoeCoopThreads, kMinBlocksPerSm) MoeCoopKernel(const MoeCoopArgs a) {
  __shared__ __align__(16) uint32_t ring[kWarps * kGemvStages * kMaxStageWords];
  __shared__ Routing routing;
  PdlEnter();
  cg::grid_group grid = cg::this_grid();
  const int lane = threadIdx.x & 31;
  const int warp_global = blockIdx.x * kWarps + (threadIdx.x >> 5);
  const int total_warps = gridDim.x * kWarps;
  uint32_t* warp_ring = ring + (threadIdx.x >> 5) * (kGemvStages * kMaxStageWords);

  RouteBlock(a, routing);
  InputPhase(a, routing, warp_global, total_warps, lane);
  grid.sync();

  const bool shared = a.d.with_shared != 0;
  CoopProjection proj[4];
  proj[0] = CoopProjection{&a.gate, true, a.b.a_gate, a.b.y_gate, a.d.hidden, a.d.inter};
  proj[1] = CoopProjection{&a.up, true, a.b.a_up, a.b.y_up, a.d.hidden, a.d.inter};
  if (shared) {
    proj[2] = CoopProjection{&a.sgate, false, a.b.sa_gate, a.b.sy_gate, a.d.hidden, a.d.shared_inter};
    proj[3] = CoopProjection{&a.sup, false, a.b.sa_up, a.b.sy_up, a.d.hidden, a.d.shared_inter};
  }
  GemvPhase(proj, shared ? 4 : 2, a, routing, warp_ring, warp_global, total_warps, lane);
  grid.sync();

  MidPhase(a, routing, warp_global, total_warps, lane);
  grid.sync();

  proj[0] = CoopProjection{&a.down, true, a.b.a_down, a.b.y_down, a.d.inter, a.d.hidden};
  if (shared) proj[1] = CoopProjection{&a.sdown, false, a.b.sa_down, a.b.sy_down, a.d.shared_inter, a.d.hidden};
  GemvPhase(proj, shared ? 2 : 1, a, routing, warp_ring, warp_global, total_warps, lane);
  grid.sync();

  CombinePhase(a, routing, warp_global, total_warps, lane);
}

}  // namespace

absl::StatusOr<int> MoeCoopBlocksPerSm() {
  int dev = 0, coop = 0, blocks = 0;
  EXL3_CUDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
  EXL3_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev));
  if (!coop) return 0;
  EXL3_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, MoeCoopKernel, kMoeCoopThreads, 0));
  return blocks;
}

absl::Status LaunchMoeCoop(const MoeCoopArgs& a, int grid, cudaStream_t stream) {
  if (a.d.T <= 0 || a.d.T * a.d.topk > kMoeCoopMaxAssign) {
    return absl::InvalidArgumentError("LaunchMoeCoop: T * top_k outside 1..kMoeCoopMaxAssign");
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(kMoeCoopThreads);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  // Cooperative (all blocks resident, grid sync allowed); a cooperative kernel is captured in a
  // CUDA graph as a kernel node with this attribute (CUDA 12+). Not combined with PDL's
  // programmatic serialization: the grid waits for its predecessor to end.
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, MoeCoopKernel, a);
  if (err == cudaErrorCooperativeLaunchTooLarge) {
    // Fewer SMs than the device reports (an MPS client limited to a share of them): the caller
    // falls back to the chain.
    (void)cudaGetLastError();
    return absl::ResourceExhaustedError("MoeCoopKernel: the cooperative grid does not fit the SMs this context may use");
  }
  EXL3_CUDA_RETURN_IF_ERROR(err);
  EXL3_CUDA_CHECK_LAUNCH("MoeCoopKernel");
  return absl::OkStatus();
}

}  // namespace exl3::cuda
