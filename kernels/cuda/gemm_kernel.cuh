// Chunked prefill GEMM on tensor cores with the trellis decode fused into the register tiles:
// y[rows, n] = A[rows, k] (fp16, input-transformed) · W_inner[k, n]. Also the expert-grouped MoE
// prefill: the same problems and row chunks as GroupedGemvKernel, with chunks of up to 128 rows.
//
// Block (8 warps) = one unit: a chunk of <= BM = kGemmBM rows x 128 columns (warp w owns 16-column tile
// 8*cg + w) x a k-slice of gemm_k_stages stages of 64 k (all of k when 0). A streams through shared memory in stages of 64 k (cp.async, double
// buffered, rows padded to avoid ldmatrix bank conflicts); each warp decodes one trellis tile per
// 16 k into mma B fragments once and reuses them for BM/16 row blocks (2 mma each), so the
// decode cost is amortised over up to 128 tokens; 16-row blocks past the chunk's rows are skipped
// (warp-uniform), so a chunk of 16 rows costs 2 mma per tile, not 16. Results are stored into y
// when one unit covers all of k; with k-slices (split-K: decode-sized row counts, where chunks x
// column groups alone leave most SMs idle) they are added into y with atomics, and y must be zero
// on entry.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/cuda/gemv_kernel.cuh"
#include "kernels/cuda/trellis_decode.cuh"

namespace exl3::cuda {

inline constexpr int kGemmLda = kGemmStageK + 8;  // padded smem row (halves)

__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void LdMatrixX4(uint32_t (&a)[4], const void* smem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(s));
}

template <int BM>
__device__ __forceinline__ int GemmChunks(const GemvProblem& p) {
  return p.chunk_expert ? *p.num_chunks : (p.rows + BM - 1) / BM;
}
__device__ __forceinline__ int GemmKSlices(const GemvProblem& p) {
  const int stages = p.k / kGemmStageK;
  return p.gemm_k_stages > 0 ? (stages + p.gemm_k_stages - 1) / p.gemm_k_stages : 1;
}

template <int K, int CB>
__global__ void __launch_bounds__(256, 2) GroupedGemmKernel(const GemvBatch batch) {
  // A 64-row variant with 3 blocks per SM was slower at m = 32..64 on an H200 (exl3-bench gemv,
  // 2026-12-01: 83 against 72 us at m = 32, 111 against 100 us at m = 64, 4096x14336 K=2).
  constexpr int BM = kGemmBM, MB = BM / 16;
  __shared__ __align__(16) __half smem_a[2][BM * kGemmLda];
  PdlEnter();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const LaneSlots<K> slots(lane);
  const int g = lane >> 2, c = lane & 3;
  constexpr int kTilesPerStage = kGemmStageK / 16;
  constexpr int NW = LaneSlots<K>::kWords;

  int units[kMaxProblems];
  int total = 0;
#pragma unroll
  for (int q = 0; q < kMaxProblems; ++q) {
    units[q] = 0;
    if (q < batch.num_problems) {
      units[q] = GemmChunks<BM>(batch.p[q]) * (batch.p[q].n / 128) * GemmKSlices(batch.p[q]);
      total += units[q];
    }
  }

  for (int u = blockIdx.x; u < total; u += gridDim.x) {
    int r = u;
    const int q = UnitProblem(units, r);
    const GemvProblem& p = batch.p[q];
    const int col_groups = p.n / 128;
    const int k_slices = GemmKSlices(p);
    const int slice = r % k_slices;
    r /= k_slices;
    const int cg = r % col_groups;
    const int chunk = r / col_groups;
    const RowChunk rc = ChunkOf(p, chunk, BM);
    const int expert = rc.expert, row0 = rc.row0, rows = rc.rows;
    const int n_tiles = p.n / 16;
    const int tile_col = cg * 8 + warp;
    const uint32_t* wbase = reinterpret_cast<const uint32_t*>(p.chunk_expert ? p.trellis[expert] : p.single) +
                            static_cast<size_t>(tile_col) * (8 * K);
    const size_t k_stride = static_cast<size_t>(n_tiles) * (8 * K);
    const int all_stages = p.k / kGemmStageK;
    const int first_stage = k_slices > 1 ? slice * p.gemm_k_stages : 0;
    const int stages = k_slices > 1 ? min(p.gemm_k_stages, all_stages - first_stage) : all_stages;
    const int row_blocks = (rows + 15) / 16;

    // stage: relative to the unit's first.
    auto load_a = [&](int stage, int buf) {
      // BM rows x 64 halves = 8 * BM 16-byte pieces, MB / 2 per thread; rows of skipped row blocks
      // are not loaded, rows past the chunk inside its last row block are zero-filled.
#pragma unroll
      for (int i = 0; i < MB / 2; ++i) {
        const int piece = threadIdx.x + 256 * i;
        const int row = piece >> 3, col = (piece & 7) * 8;
        if (row >= row_blocks * 16) continue;
        const bool valid = row < rows;
        const __half* src = p.a + static_cast<size_t>(row0 + (valid ? row : 0)) * p.k +
                            (first_stage + stage) * kGemmStageK + col;
        CpAsync16(&smem_a[buf][row * kGemmLda + col], src, valid);
      }
      CpAsyncCommit();
    };
    auto load_w = [&](int stage, uint32_t (&w)[kTilesPerStage][NW]) {
#pragma unroll
      for (int t = 0; t < kTilesPerStage; ++t)
        LoadLaneWords<K>(wbase + (static_cast<size_t>(first_stage + stage) * kTilesPerStage + t) * k_stride, slots,
                         w[t]);
    };

    float acc[MB][2][4];
#pragma unroll
    for (int m = 0; m < MB; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[m][h][i] = 0.f;

    // The weights stream through a ring of kWStages stages in registers, loaded kWStages - 1
    // stages ahead of their decode (one stage ahead left a unit waiting on memory at every stage
    // when the chunk has few rows: little mma work per weight to hide the load behind).
    constexpr int kWStages = K <= 4 ? 3 : 2;
    uint32_t wring[kWStages][kTilesPerStage][NW];
    load_a(0, 0);
#pragma unroll
    for (int r = 0; r < kWStages - 1; ++r)
      if (r < stages) load_w(r, wring[r]);
    for (int s0 = 0; s0 < stages; s0 += kWStages) {
#pragma unroll
      for (int r = 0; r < kWStages; ++r) {
        const int s = s0 + r;
        if (s >= stages) break;
        // Into the slot stage s - 1 used (its decode is done).
        if (s + kWStages - 1 < stages) load_w(s + kWStages - 1, wring[(r + kWStages - 1) % kWStages]);
        if (s + 1 < stages) {
          load_a(s + 1, (s + 1) & 1);
          CpAsyncWait<1>();
        } else {
          CpAsyncWait<0>();
        }
        __syncthreads();
        const __half* abuf = smem_a[s & 1];
#pragma unroll
        for (int kk = 0; kk < kTilesPerStage; ++kk) {
          uint32_t b[4];
          DecodeLane<K, CB>(wring[r][kk], slots.shift, b);
#pragma unroll
          for (int m = 0; m < MB; ++m) {
            if (m >= row_blocks) break;
            uint32_t a[4];
            LdMatrixX4(a, abuf + (m * 16 + (lane & 15)) * kGemmLda + kk * 16 + (lane >> 4) * 8);
            Mma16816(acc[m][0], a, b[0], b[1]);
            Mma16816(acc[m][1], a, b[2], b[3]);
          }
        }
        __syncthreads();
      }
    }

#pragma unroll
    for (int m = 0; m < MB; ++m) {
      const int r_lo = m * 16 + g, r_hi = r_lo + 8;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int col = tile_col * 16 + 8 * h + 2 * c;
        float* y_lo = p.y + static_cast<size_t>(row0 + r_lo) * p.n + col;
        float* y_hi = p.y + static_cast<size_t>(row0 + r_hi) * p.n + col;
        if (k_slices > 1) {
          if (r_lo < rows) {
            atomicAdd(y_lo, acc[m][h][0]);
            atomicAdd(y_lo + 1, acc[m][h][1]);
          }
          if (r_hi < rows) {
            atomicAdd(y_hi, acc[m][h][2]);
            atomicAdd(y_hi + 1, acc[m][h][3]);
          }
        } else {
          if (r_lo < rows) *reinterpret_cast<float2*>(y_lo) = make_float2(acc[m][h][0], acc[m][h][1]);
          if (r_hi < rows) *reinterpret_cast<float2*>(y_hi) = make_float2(acc[m][h][2], acc[m][h][3]);
        }
      }
    }
  }
}

template <int K, int CB>
void LaunchGroupedGemm(const GemvBatch& batch, int grid, cudaStream_t stream) {
  LaunchPdl(GroupedGemmKernel<K, CB>, dim3(grid), dim3(256), stream, batch);
}

// Dequantisation: W_inner fp16 [k, n] row-major, one warp per tile, staged through shared memory
// so that global writes are whole 32-byte tile rows.
template <int K, int CB>
__global__ void __launch_bounds__(256) DequantKernel(const uint16_t* __restrict__ trellis, int k, int n,
                                                     uint16_t* __restrict__ out) {
  __shared__ uint16_t tile_smem[8][256];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const LaneSlots<K> slots(lane);
  const int n_tiles = n / 16;
  const long total = static_cast<long>(k / 16) * n_tiles;
  for (long tile = static_cast<long>(blockIdx.x) * 8 + warp; tile < total;
       tile += static_cast<long>(gridDim.x) * 8) {
    uint32_t w[LaneSlots<K>::kWords];
    LoadLaneWords<K>(reinterpret_cast<const uint32_t*>(trellis) + tile * (8 * K), slots, w);
    uint32_t b[4];
    DecodeLane<K, CB>(w, slots.shift, b);
    const int r0 = 2 * (lane & 3), c0 = lane >> 2;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      // q: (j = 2q, 2q+1): rows r0 + (q&1)*8 + {0,1}, column c0 + (q>>1)*8.
      const int row = r0 + (q & 1) * 8, col = c0 + (q >> 1) * 8;
      tile_smem[warp][row * 16 + col] = static_cast<uint16_t>(b[q] & 0xffffu);
      tile_smem[warp][(row + 1) * 16 + col] = static_cast<uint16_t>(b[q] >> 16);
    }
    __syncwarp();
    const int ti = static_cast<int>(tile / n_tiles), tj = static_cast<int>(tile % n_tiles);
    // 16 rows x 32 bytes: lane writes 16 bytes (half a row).
    const int row = lane >> 1, half = lane & 1;
    const uint4 v = *reinterpret_cast<const uint4*>(&tile_smem[warp][row * 16 + half * 8]);
    *reinterpret_cast<uint4*>(out + static_cast<size_t>(ti * 16 + row) * n + tj * 16 + half * 8) = v;
    __syncwarp();
  }
}

template <int K, int CB>
void LaunchDequant(const uint16_t* trellis, int k, int n, uint16_t* out, int grid, cudaStream_t stream) {
  DequantKernel<K, CB><<<grid, 256, 0, stream>>>(trellis, k, n, out);
}

}  // namespace exl3::cuda
