// The MoE layer's kernels and their launchers (moe_kernels.h).
#include "kernels/cuda/moe_kernels.h"

#include <algorithm>
#include <cmath>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/moe_activation.cuh"
#include "kernels/cuda/transform_kernels.cuh"

namespace exl3::cuda {

constexpr int kRouteThreads = 1024;

// One block: groups T*topk assignments by expert (ranks within an expert in arrival order of a
// shared-memory atomic), prefix sums of counts and chunk counts, chunk list. The prefix runs over
// the experts in class order (classes.order; id order when null), so each (K, codebook) class's
// chunks are contiguous; their ranges go to o.class_chunk0/class_chunks.
//   ids, weights      [num_assign] int32 / fp32 (num_assign = T*topk)
//   held              [num_experts] device pointers, null for an expert not held (skipped)
//   classes.order     [num_experts] int32, classes.class_first [num_classes + 1] int32, or null
//   o                 RouteOut (moe_kernels.h): slots [num_assign], chunks [<= num_assign +
//                     num_experts], counts [2], class ranges [num_classes]
__global__ void __launch_bounds__(kRouteThreads) RouteKernel(const int32_t* __restrict__ ids,
                                                             const float* __restrict__ weights, int num_assign,
                                                             int topk, int num_experts,
                                                             const uint16_t* const* __restrict__ held,
                                                             RouteClasses classes, int chunk_size, RouteOut o) {
  __shared__ int count[kMaxExperts];
  __shared__ unsigned long long scan[kMaxExperts];  // (chunks << 32) | rows, exclusive prefix
  __shared__ unsigned long long warp_tot[32];
  __shared__ int total_chunks;
  PdlEnter();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int e = tid; e < num_experts; e += kRouteThreads) count[e] = 0;
  __syncthreads();
  for (int i = tid; i < num_assign; i += kRouteThreads) {
    const int e = ids[i];
    int rank = -1;
    if (e >= 0 && e < num_experts && held[e] != nullptr) rank = atomicAdd(&count[e], 1);
    o.assign_slot[i] = rank;  // temporarily the rank
  }
  __syncthreads();
  // Block exclusive scan over experts in class order; thread tid owns positions
  // [tid*per, (tid+1)*per) of it.
  const int per = (num_experts + kRouteThreads - 1) / kRouteThreads;
  unsigned long long local = 0;
  for (int j = 0; j < per; ++j) {
    const int pos = tid * per + j;
    if (pos < num_experts) {
      const int e = classes.order ? classes.order[pos] : pos;
      const unsigned long long c = count[e];
      local += (((c + chunk_size - 1) / chunk_size) << 32) | c;
    }
  }
  unsigned long long incl = local;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const unsigned long long v = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += v;
  }
  if (lane == 31) warp_tot[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    unsigned long long w = warp_tot[lane];
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const unsigned long long v = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += v;
    }
    warp_tot[lane] = w;  // inclusive
  }
  __syncthreads();
  unsigned long long run = incl - local + (warp > 0 ? warp_tot[warp - 1] : 0ull);
  for (int j = 0; j < per; ++j) {
    const int pos = tid * per + j;
    if (pos < num_experts) {
      const int e = classes.order ? classes.order[pos] : pos;
      scan[e] = run;
      const unsigned long long c = count[e];
      run += (((c + chunk_size - 1) / chunk_size) << 32) | c;
    }
  }
  if (tid == kRouteThreads - 1) {
    o.counts[0] = static_cast<int>(run & 0xffffffffu);
    o.counts[1] = static_cast<int>(run >> 32);
    total_chunks = static_cast<int>(run >> 32);
  }
  __syncthreads();
  if (classes.order) {
    // Class k starts at the chunk prefix of its first expert; the experts after the last class
    // are not held (no chunks), so the last class ends at the total.
    for (int k = tid; k < classes.num_classes; k += kRouteThreads) {
      const int p0 = classes.class_first[k], p1 = classes.class_first[k + 1];
      const int c0 = static_cast<int>(scan[classes.order[p0]] >> 32);
      const int c1 = p1 < num_experts ? static_cast<int>(scan[classes.order[p1]] >> 32) : total_chunks;
      o.class_chunk0[k] = c0;
      o.class_chunks[k] = c1 - c0;
    }
  }
  for (int i = tid; i < num_assign; i += kRouteThreads) {
    const int rank = o.assign_slot[i];
    if (rank < 0) continue;
    const int e = ids[i];
    const int slot = static_cast<int>(scan[e] & 0xffffffffu) + rank;
    o.slot_token[slot] = i / topk;
    o.slot_expert[slot] = e;
    o.slot_weight[slot] = weights[i];
    o.assign_slot[i] = slot;
  }
  for (int e = tid; e < num_experts; e += kRouteThreads) {
    const int c = count[e];
    if (c == 0) continue;
    const int row0 = static_cast<int>(scan[e] & 0xffffffffu);
    const int ch0 = static_cast<int>(scan[e] >> 32);
    for (int j = 0; j * chunk_size < c; ++j) {
      o.chunk_expert[ch0 + j] = e;
      o.chunk_row0[ch0 + j] = row0 + j * chunk_size;
      o.chunk_rows[ch0 + j] = min(chunk_size, c - j * chunk_size);
    }
  }
}

// Rows [0, T*topk): routed slots; [T*topk, T*topk + T): shared-expert token rows. One warp per
// (row, 128-block of hidden); 4 warps per block. With zero_outputs each warp also zeroes its share
// of the row's accumulators (gate/up: inter / (hidden/128) floats, down: its 128-block), which the
// projections then add into (the GEMV's atomics); the prefill GEMM stores every output instead,
// and the zeros were two thirds of this kernel's bytes there.
__global__ void __launch_bounds__(128) MoeInputKernel(const float* __restrict__ x, MoeDims d, ProjTable gate,
                                                      ProjTable up, ProjTable sgate, ProjTable sup,
                                                      const float* shared_gate_vec, RouteOut r, MoeBuffers b,
                                                      bool zero_outputs) {
  PdlEnter();
  const int lane = threadIdx.x & 31;
  const int per_row = d.hidden / 128;
  const int w = blockIdx.x * 4 + (threadIdx.x >> 5);
  const int row_all = w / per_row, blk = w % per_row;
  const int routed = d.T * d.topk;
  if (row_all >= routed + (d.with_shared ? d.T : 0)) return;
  int token, row;
  const uint16_t *suh_g, *suh_u;
  __half *ag, *au;
  float *yg, *yu, *yd;
  int n_inter;
  if (row_all < routed) {
    row = row_all;
    if (row >= r.counts[0]) return;
    token = r.slot_token[row];
    const int e = r.slot_expert[row];
    suh_g = gate.suh[e];
    suh_u = up.suh[e];
    ag = b.a_gate; au = b.a_up; yg = b.y_gate; yu = b.y_up; yd = b.y_down;
    n_inter = d.inter;
  } else {
    row = token = row_all - routed;
    suh_g = sgate.suh[0];
    suh_u = sup.suh[0];
    ag = b.sa_gate; au = b.sa_up; yg = b.sy_gate; yu = b.sy_up; yd = b.sy_down;
    n_inter = d.shared_inter;
  }
  const float* xr = x + static_cast<size_t>(token) * d.hidden;
  InputBlock(xr + 128 * blk, suh_g + 128 * blk, ag + static_cast<size_t>(row) * d.hidden + 128 * blk, lane);
  InputBlock(xr + 128 * blk, suh_u + 128 * blk, au + static_cast<size_t>(row) * d.hidden + 128 * blk, lane);
  if (zero_outputs) {
    const int share = (n_inter + per_row - 1) / per_row;
    for (int i = blk * share + lane; i < min(n_inter, (blk + 1) * share); i += 32) {
      yg[static_cast<size_t>(row) * n_inter + i] = 0.f;
      yu[static_cast<size_t>(row) * n_inter + i] = 0.f;
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) yd[static_cast<size_t>(row) * d.hidden + 128 * blk + 32 * q + lane] = 0.f;
  }
  if (row_all >= routed && blk == 0) {
    // Shared-expert output scale: sigmoid(x · shared_gate) (Qwen3-Next) or 1.
    float s = 0.f;
    if (shared_gate_vec) {
      for (int i = lane; i < d.hidden; i += 32) s += xr[i] * shared_gate_vec[i];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (lane == 0) b.shared_scale[token] = 1.f / (1.f + expf(-s));
    } else if (lane == 0) {
      b.shared_scale[token] = 1.f;
    }
  }
}

// One warp per (row, 128-block of the intermediate); per_row = max(inter, shared_inter) / 128.
// The routed or the shared expert's tables are chosen by value: a pointer to a kernel parameter
// (const ProjTable* G = &gate) made every thread copy all six tables to a 432-byte local-memory
// frame first, which at prefill (T · (top_k + 1) · inter / 128 warps) cost far more than the
// block's own loads and stores.
__global__ void __launch_bounds__(128) MoeMidKernel(MoeDims d, ProjTable gate, ProjTable up, ProjTable down,
                                                    ProjTable sgate, ProjTable sup, ProjTable sdown, RouteOut r,
                                                    MoeBuffers b) {
  PdlEnter();
  const int lane = threadIdx.x & 31;
  const int per_row = max(d.inter, d.shared_inter) / 128;
  const int w = blockIdx.x * 4 + (threadIdx.x >> 5);
  const int row_all = w / per_row, blk = w % per_row;
  const int routed = d.T * d.topk;
  if (row_all >= routed + (d.with_shared ? d.T : 0)) return;
  const bool is_routed = row_all < routed;
  const int row = is_routed ? row_all : row_all - routed;
  if (is_routed && row >= r.counts[0]) return;
  const int e = is_routed ? r.slot_expert[row] : 0;
  const int n_inter = is_routed ? d.inter : d.shared_inter;
  if (blk >= n_inter / 128) return;
  const float limit = is_routed ? d.limit : d.shared_limit;
  const float* yg = is_routed ? b.y_gate : b.sy_gate;
  const float* yu = is_routed ? b.y_up : b.sy_up;
  __half* ad = is_routed ? b.a_down : b.sa_down;
  const uint16_t* svh_g = (is_routed ? gate.svh : sgate.svh)[e];
  const uint16_t* svh_u = (is_routed ? up.svh : sup.svh)[e];
  const uint16_t* suh_d = (is_routed ? down.suh : sdown.suh)[e];
  const uint16_t* bias_g = (is_routed ? gate.bias : sgate.bias)[e];
  const uint16_t* bias_u = (is_routed ? up.bias : sup.bias)[e];
  const size_t off = static_cast<size_t>(row) * n_inter + 128 * blk;
  ActivateBlock(yg + off, yu + off, svh_g + 128 * blk, bias_g ? bias_g + 128 * blk : nullptr, svh_u + 128 * blk,
                bias_u ? bias_u + 128 * blk : nullptr, suh_d + 128 * blk, limit, ad + off, lane);
}

// Warps of a MoeCombineKernel block at most: its items (the token's assignments and the shared
// expert) are spread over them; shared memory an item: its 128 values, its weight and whether kept.
constexpr int kCombineMaxWarps = 16;
constexpr int kCombineSmemFloatsPerItem = 130;

// One block per (token, 128-block of hidden): out = sum over the token's assignments + shared.
// Block: 32 · min(items, kCombineMaxWarps) threads, items = topk (+ 1 with the shared expert);
// dynamic shared memory: kCombineSmemFloatsPerItem floats an item. Warp w transforms items w,
// w + warps, ... (each assignment's chain slot -> expert -> scales -> values waited on once, beside
// the others' instead of after them); warp 0 then adds them in the assignments' order, the shared
// expert last: the float operations of one warp adding them in turn, in the same order.
__global__ void MoeCombineKernel(MoeDims d, ProjTable down, ProjTable sdown, RouteOut r, MoeBuffers b,
                                 float* __restrict__ out) {
  PdlEnter();
  extern __shared__ float combine_smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int per_row = d.hidden / 128;
  const int t = blockIdx.x / per_row, blk = blockIdx.x % per_row;
  const int items = d.topk + (d.with_shared ? 1 : 0);
  float* values = combine_smem;                                       // [items][128]: transformed blocks
  float* weights = values + items * 128;                              // [items]
  int* kept = reinterpret_cast<int*>(weights + items);                // [items]: 0 where dropped
  for (int i = warp; i < items; i += warps) {
    const bool routed = i < d.topk;
    const int slot = routed ? r.assign_slot[t * d.topk + i] : 0;
    if (routed && slot < 0) {  // an expert no one holds
      if (lane == 0) kept[i] = 0;
      continue;
    }
    float v[4];
    if (routed) {
      const int e = r.slot_expert[slot];
      const uint16_t* bias = down.bias[e];
      OutputBlock(b.y_down + static_cast<size_t>(slot) * d.hidden + 128 * blk, down.svh[e] + 128 * blk,
                  bias ? bias + 128 * blk : nullptr, v, lane);
    } else {
      const uint16_t* bias = sdown.bias[0];
      OutputBlock(b.sy_down + static_cast<size_t>(t) * d.hidden + 128 * blk, sdown.svh[0] + 128 * blk,
                  bias ? bias + 128 * blk : nullptr, v, lane);
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) values[i * 128 + 32 * q + lane] = v[q];
    if (lane == 0) {
      weights[i] = routed ? r.slot_weight[slot] : b.shared_scale[t];
      kept[i] = 1;
    }
  }
  __syncthreads();
  if (warp != 0) return;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int i = 0; i < items; ++i) {
    if (!kept[i]) continue;
    const float wt = weights[i];
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[q] += wt * values[i * 128 + 32 * q + lane];
  }
#pragma unroll
  for (int q = 0; q < 4; ++q) out[static_cast<size_t>(t) * d.hidden + 128 * blk + 32 * q + lane] = acc[q];
}

absl::Status LaunchRoute(const int32_t* ids, const float* weights, int num_assign, int topk, int num_experts,
                         const uint16_t* const* held, const RouteClasses& classes, int chunk_size,
                         const RouteOut& o, cudaStream_t stream) {
  LaunchPdl(RouteKernel, dim3(1), dim3(kRouteThreads), stream, ids, weights, num_assign, topk, num_experts, held,
            classes, chunk_size, o);
  EXL3_CUDA_CHECK_LAUNCH("RouteKernel");
  return absl::OkStatus();
}

absl::Status LaunchMoeInput(int rows, const float* x, const MoeDims& d, const ProjTable& gate, const ProjTable& up,
                            const ProjTable& sgate, const ProjTable& sup, const float* shared_gate_vec,
                            const RouteOut& r, const MoeBuffers& b, bool zero_outputs, cudaStream_t stream) {
  LaunchPdl(MoeInputKernel, dim3((rows * (d.hidden / 128) + 3) / 4), dim3(128), stream, x, d, gate, up, sgate,
            sup, shared_gate_vec, r, b, zero_outputs);
  EXL3_CUDA_CHECK_LAUNCH("MoeInputKernel");
  return absl::OkStatus();
}

absl::Status LaunchMoeMid(int rows, const MoeDims& d, const ProjTable& gate, const ProjTable& up,
                          const ProjTable& down, const ProjTable& sgate, const ProjTable& sup,
                          const ProjTable& sdown, const RouteOut& r, const MoeBuffers& b, cudaStream_t stream) {
  const int mid_per_row = std::max(d.inter, d.shared_inter) / 128;
  LaunchPdl(MoeMidKernel, dim3((rows * mid_per_row + 3) / 4), dim3(128), stream, d, gate, up, down, sgate, sup,
            sdown, r, b);
  EXL3_CUDA_CHECK_LAUNCH("MoeMidKernel");
  return absl::OkStatus();
}

absl::Status LaunchMoeCombine(const MoeDims& d, const ProjTable& down, const ProjTable& sdown, const RouteOut& r,
                              const MoeBuffers& b, float* out, cudaStream_t stream) {
  const int items = d.topk + (d.with_shared ? 1 : 0);
  const int warps = std::max(1, std::min(items, kCombineMaxWarps));
  const size_t smem = static_cast<size_t>(items) * kCombineSmemFloatsPerItem * sizeof(float);
  LaunchPdlWithSmem(MoeCombineKernel, dim3(d.T * (d.hidden / 128)), dim3(32 * warps), smem, stream, d, down, sdown, r,
                    b, out);
  EXL3_CUDA_CHECK_LAUNCH("MoeCombineKernel");
  return absl::OkStatus();
}

}  // namespace exl3::cuda
