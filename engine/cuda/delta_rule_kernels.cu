#include "engine/cuda/delta_rule_kernels.h"

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "engine/cuda/launch_status.cuh"
#include "engine/cuda/recurrent_chunks.cuh"
#include "kernels/cuda/launch.cuh"

namespace exl3::engine::cuda {
namespace {

constexpr int kMaxKeyDim = 128;
constexpr int kColumnsPerWarp = 4;   // lane = row group r · 4 + column c
constexpr int kRowGroups = 8;        // lanes per column
constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kColumnsPerBlock = kColumnsPerWarp * kWarps;
constexpr int kQuads = kMaxKeyDim / 4;             // a key vector as float4s
constexpr int kQuadsPerLane = kQuads / kRowGroups;  // 4: the lane's 16 key rows
constexpr int kTile = 8;                            // tokens staged per pass
constexpr int kStagePerThread = kTile * kMaxKeyDim / kThreads;  // k, q and g elements a thread stages
constexpr unsigned kFullMask = 0xffffffffu;

static_assert(kColumnsPerWarp * kRowGroups == 32);
static_assert(kTile * kMaxKeyDim % kThreads == 0 && kTile * kColumnsPerBlock == kThreads);

// The eight lanes of a column (row groups r = lane bits 2 to 4) sum their parts.
__device__ __forceinline__ float ColumnSum(float v) {
  v += __shfl_xor_sync(kFullMask, v, 4);
  v += __shfl_xor_sync(kFullMask, v, 8);
  v += __shfl_xor_sync(kFullMask, v, 16);
  return v;
}

// The lane's part of S (column e, the key rows below) into one head's state `to` [DK, DV].
__device__ __forceinline__ void StoreColumn(const float (&s)[kQuadsPerLane][4], float* to, int r, int e, int DK,
                                            int DV, bool live) {
#pragma unroll
  for (int i = 0; i < kQuadsPerLane; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int a = (i * kRowGroups + r) * 4 + j;
      if (live && a < DK) to[static_cast<size_t>(a) * DV + e] = s[i][j];
    }
  }
}

// One pass's inputs as a thread loads them (registers), the next pass's while this one's run.
struct StagedInputs {
  float k[kStagePerThread], q[kStagePerThread], g[kStagePerThread];  // g: decay as stored (log or not)
  float v, b;
};

// grid num_chunks · num_heads · ceil(DV / 32), block kThreads. Lane (r, c) of warp w holds column
// e = group · 32 + w · 4 + c of S, key rows a = (i · 8 + r) · 4 + j for i < 4, j < 4 (float4 i · 8 +
// r of a key vector: the eight row groups read 128 consecutive bytes of shared memory). Rows at or
// past DK are zero in S, k and q, and one in g, so they change nothing. Eight lanes a column (and
// two partial sums a lane) keep each token's dependent chain of FMAs and shuffles short, and a
// prefill's 256 blocks of a (chunk, head) 8 warps each: the kernel is bound by the latency of that
// chain, token after token. The next pass's k, q, g, v and β load into registers while a pass
// runs. kKeepsStates: a verify chunk may be among the chunks (RecurrentChunks::max_kept_states >
// 1), whose S after each kept token but the last is stored on the way; without it the kernel is the
// plain step's alone (its registers do not hold what the stores need).
template <bool kKeepsStates>
__global__ void __launch_bounds__(kThreads, 2)
    DeltaRuleKernel(const float* __restrict__ conv_out, const float* __restrict__ beta,
                    const float* __restrict__ decay, DeltaRuleDecay form, DeltaRuleShape sh,
                    RecurrentChunks chunks, int first_chunk, float* __restrict__ core) {
  exl3::cuda::PdlEnter();
  __shared__ float4 k_s[kTile][kQuads];
  __shared__ float4 q_s[kTile][kQuads];
  __shared__ float4 g_s[kTile][kQuads];
  __shared__ float v_s[kTile][kColumnsPerBlock];
  __shared__ float b_s[kTile];
  const int NH = sh.num_heads, DK = sh.key_head_dim, DV = sh.value_head_dim;
  const int groups = (DV + kColumnsPerBlock - 1) / kColumnsPerBlock;
  const int group = static_cast<int>(blockIdx.x % groups);
  const int h = static_cast<int>(blockIdx.x / groups) % NH;
  const RecurrentChunk c = LoadChunk(chunks, first_chunk + static_cast<int>(blockIdx.x / groups / NH));
  const int kh = h / sh.heads_per_key_head;
  const int lane = threadIdx.x % 32, r = lane / kColumnsPerWarp;
  const int col = (threadIdx.x / 32) * kColumnsPerWarp + lane % kColumnsPerWarp;
  const int e = group * kColumnsPerBlock + col;
  const bool live = e < DV;
  const size_t head = static_cast<size_t>(sh.state_at) + static_cast<size_t>(h) * DK * DV;
  const float* prev = StateRow(chunks, c.read_row) + head;

  // Pass j0's inputs for this thread: element i = threadIdx.x + m · kThreads of the pass's k, q and
  // g (token i / kMaxKeyDim, row i % kMaxKeyDim), v of token threadIdx.x / 32 at column
  // threadIdx.x % 32 of the block's, β of token threadIdx.x.
  auto load = [&](int j0, StagedInputs& in) {
    const int n = min(kTile, c.tokens - j0);
#pragma unroll
    for (int m = 0; m < kStagePerThread; ++m) {
      const int i = threadIdx.x + m * kThreads, t = i / kMaxKeyDim, a = i % kMaxKeyDim;
      const bool on = t < n && a < DK;
      const size_t row = static_cast<size_t>(c.first + j0 + t);
      const float* x = conv_out + row * sh.row_floats;
      in.k[m] = on ? x[sh.k_at + kh * DK + a] : 0.f;
      in.q[m] = on ? x[sh.q_at + kh * DK + a] : 0.f;
      in.g[m] = !on ? 0.f
                : form == DeltaRuleDecay::kPerHead ? decay[row * NH + h]
                                                   : decay[(row * NH + h) * DK + a];
    }
    const int t = threadIdx.x / kColumnsPerBlock, ee = group * kColumnsPerBlock + threadIdx.x % kColumnsPerBlock;
    in.v = t < n && ee < DV
               ? conv_out[static_cast<size_t>(c.first + j0 + t) * sh.row_floats + sh.v_at + static_cast<size_t>(h) * DV + ee]
               : 0.f;
    in.b = threadIdx.x < n ? beta[static_cast<size_t>(c.first + j0 + threadIdx.x) * NH + h] : 0.f;
  };
  float* k_f = &k_s[0][0].x;
  float* q_f = &q_s[0][0].x;
  float* g_f = &g_s[0][0].x;
  auto stage = [&](const StagedInputs& in) {
#pragma unroll
    for (int m = 0; m < kStagePerThread; ++m) {
      const int i = threadIdx.x + m * kThreads, a = i % kMaxKeyDim;
      k_f[i] = in.k[m];
      q_f[i] = in.q[m];
      g_f[i] = a >= DK ? 1.f : form == DeltaRuleDecay::kPerHead ? in.g[m] : expf(in.g[m]);
    }
    v_s[threadIdx.x / kColumnsPerBlock][threadIdx.x % kColumnsPerBlock] = in.v;
    if (threadIdx.x < kTile) b_s[threadIdx.x] = in.b;
  };

  float s[kQuadsPerLane][4];
#pragma unroll
  for (int i = 0; i < kQuadsPerLane; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int a = (i * kRowGroups + r) * 4 + j;
      s[i][j] = live && a < DK ? prev[static_cast<size_t>(a) * DV + e] : 0.f;
    }
  }
  StagedInputs next;
  if (c.tokens > 0) load(0, next);
  for (int j0 = 0; j0 < c.tokens; j0 += kTile) {
    const int n = min(kTile, c.tokens - j0);
    __syncthreads();  // the previous pass is read
    stage(next);
    __syncthreads();
    if (j0 + kTile < c.tokens) load(j0 + kTile, next);  // in flight during this pass
#pragma unroll 1
    for (int t = 0; t < n; ++t) {
      float4 k[kQuadsPerLane];
      float kv0 = 0.f, kv1 = 0.f;  // (Sᵀk)[e] after the decay: rows of even and odd i
#pragma unroll
      for (int i = 0; i < kQuadsPerLane; ++i) {
        k[i] = k_s[t][i * kRowGroups + r];
        const float4 g = g_s[t][i * kRowGroups + r];
        float& kv = i % 2 == 0 ? kv0 : kv1;
        s[i][0] *= g.x; kv = fmaf(s[i][0], k[i].x, kv);
        s[i][1] *= g.y; kv = fmaf(s[i][1], k[i].y, kv);
        s[i][2] *= g.z; kv = fmaf(s[i][2], k[i].z, kv);
        s[i][3] *= g.w; kv = fmaf(s[i][3], k[i].w, kv);
      }
      const float delta = (v_s[t][col] - ColumnSum(kv0 + kv1)) * b_s[t];
      float o0 = 0.f, o1 = 0.f;
#pragma unroll
      for (int i = 0; i < kQuadsPerLane; ++i) {
        const float4 q = q_s[t][i * kRowGroups + r];
        float& o = i % 2 == 0 ? o0 : o1;
        s[i][0] = fmaf(k[i].x, delta, s[i][0]); o = fmaf(s[i][0], q.x, o);
        s[i][1] = fmaf(k[i].y, delta, s[i][1]); o = fmaf(s[i][1], q.y, o);
        s[i][2] = fmaf(k[i].z, delta, s[i][2]); o = fmaf(s[i][2], q.z, o);
        s[i][3] = fmaf(k[i].w, delta, s[i][3]); o = fmaf(s[i][3], q.w, o);
      }
      const float o = ColumnSum(o0 + o1);
      if (r == 0 && live) {
        const size_t row = static_cast<size_t>(c.first + j0 + t);
        core[(row * NH + h) * DV + e] = o;
      }
      if constexpr (kKeepsStates) {
        // A verify chunk keeps S after each of its kept tokens but the last (stored below).
        const int kept = j0 + t - c.first_kept_token();
        if (kept >= 0 && kept < c.kept_states - 1)
          StoreColumn(s, StateRow(chunks, c.KeptRow(kept)) + head, r, e, DK, DV, live);
      }
    }
  }
  StoreColumn(s, StateRow(chunks, c.write_row) + head, r, e, DK, DV, live);
}

}  // namespace

absl::Status CheckDeltaRuleShape(const DeltaRuleShape& shape) {
  if (shape.num_heads <= 0 || shape.heads_per_key_head <= 0 ||
      shape.num_heads % shape.heads_per_key_head != 0 || shape.key_head_dim <= 0 ||
      shape.value_head_dim <= 0)
    return absl::InvalidArgumentError(absl::StrCat(
        "delta rule: ", shape.num_heads, " value heads, ", shape.heads_per_key_head,
        " per key head, heads of ", shape.key_head_dim, " x ", shape.value_head_dim));
  if (shape.key_head_dim > kMaxKeyDim)
    return absl::UnimplementedError(absl::StrCat("delta rule: key_head_dim ", shape.key_head_dim,
                                                 " above the recurrence kernel's ", kMaxKeyDim));
  return absl::OkStatus();
}

absl::Status DeltaRuleRecurrence(const float* conv_out, const float* beta, const float* decay,
                                 DeltaRuleDecay form, const DeltaRuleShape& shape,
                                 const RecurrentChunks& chunks, int first_chunk, int num_chunks,
                                 float* core, StreamHandle stream) {
  if (num_chunks <= 0) return absl::OkStatus();
  const unsigned groups = (shape.value_head_dim + kColumnsPerBlock - 1) / kColumnsPerBlock;
  const unsigned blocks = static_cast<unsigned>(num_chunks) * shape.num_heads * groups;
  if (chunks.max_kept_states > 1) {
    exl3::cuda::LaunchPdl(DeltaRuleKernel<true>, dim3(blocks), dim3(kThreads), S(stream), conv_out, beta, decay, form,
                          shape, chunks, first_chunk, core);
  } else {
    exl3::cuda::LaunchPdl(DeltaRuleKernel<false>, dim3(blocks), dim3(kThreads), S(stream), conv_out, beta, decay, form,
                          shape, chunks, first_chunk, core);
  }
  return LaunchStatus("DeltaRuleRecurrence");
}

}  // namespace exl3::engine::cuda
