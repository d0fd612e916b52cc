#include "engine/cuda/dense_gemv_kernels.h"

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "engine/cuda/launch_status.cuh"
#include "kernels/cuda/launch.cuh"

namespace exl3::engine::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kWarps = 8;         // output features of a block, one a warp
constexpr int kBatch = 4;         // weight loads a lane issues before it uses the first
constexpr int kMaxSplits = 8;     // blocks of a cluster (the portable limit)
constexpr int kFillBlocks = 512;  // blocks from which a launch needs no split (4 a multiprocessor on an H100)
constexpr int kNarrowOutputs = 4; // outputs of a warp where a row is at most 32 units (DenseGemvNarrowKernel)
constexpr unsigned kFullMask = 0xffffffffu;

struct Jobs {
  DenseGemvJob job[kDenseGemvMaxJobs];  // x filled in: the job's own or the shared one
  int first[kDenseGemvMaxJobs + 1];     // job j's outputs are [first[j], first[j + 1]) of the launch's
  int count;
};

// Output g of the launch: *j its job, *o its feature there; false past the last.
__device__ __forceinline__ bool Locate(const Jobs& jobs, int g, int* j, int* o) {
  int k = 0;
  while (k < jobs.count && g >= jobs.first[k + 1]) ++k;
  if (k == jobs.count) return false;
  *j = k;
  *o = g - jobs.first[k];
  return true;
}

__device__ __forceinline__ float4 Load(const float4* p) { return __ldg(p); }
__device__ __forceinline__ float Load(const float* p) { return __ldg(p); }
__device__ __forceinline__ void Zero(float4* v) { *v = make_float4(0.f, 0.f, 0.f, 0.f); }
__device__ __forceinline__ void Zero(float* v) { *v = 0.f; }
__device__ __forceinline__ float Dot(float4 w, float4 x, float acc) {
  return fmaf(w.x, x.x, fmaf(w.y, x.y, fmaf(w.z, x.z, fmaf(w.w, x.w, acc))));
}
__device__ __forceinline__ float Dot(float w, float x, float acc) { return fmaf(w, x, acc); }

// A warp's sums over its slice [begin, end) of the input units (float4 or float) of weight row w
// against every row t < T ≤ kRows of x [T, units]: acc[t], the same in every lane.
template <int kRows, typename Unit>
__device__ __forceinline__ void SliceDots(const Unit* __restrict__ w, const Unit* __restrict__ x, int units, int T,
                                          int begin, int end, float (&acc)[kRows]) {
  const int lane = threadIdx.x % 32;
  for (int i0 = begin + lane; i0 < end; i0 += 32 * kBatch) {
    Unit wv[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int i = i0 + 32 * b;
      if (i < end) {
        wv[b] = Load(w + i);
      } else {
        Zero(&wv[b]);
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int i = i0 + 32 * b;
      if (i >= end) break;
#pragma unroll
      for (int t = 0; t < kRows; ++t) {
        if (t < T) acc[t] = Dot(wv[b], Load(x + static_cast<size_t>(t) * units + i), acc[t]);
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kRows; ++t) {
    float v = acc[t];
    for (int s = 16; s > 0; s >>= 1) v += __shfl_xor_sync(kFullMask, v, s);
    acc[t] = v;
  }
}

// grid tiles · splits blocks, block 32 · kWarps; kSplit: clusters of `splits` blocks (one tile
// each, launched with the cluster dimension), else splits = 1. Warp w of tile b computes output
// g = b · kWarps + w of the launch (job j, feature o: Locate) for every row t < T ≤ kRows:
//   y_j [T, out_j] fp32 = x_j [T, in] fp32 · W_j [out_j, in]ᵀ fp32 (+ bias_j [out_j] fp32).
// Block p of a cluster sums input units [p · chunk, (p + 1) · chunk) (units: float4 where kVector
// — in % 4 == 0, every x and W 16-byte aligned — else floats); its warps' sums go to shared memory
// and output (w, t) is finished by the block of rank (w · kRows + t) % splits, adding the blocks'
// sums in rank order. kRows (1, 2, 4 or 8) sizes the accumulators: fewer registers at batch 1.
template <int kRows, bool kVector, bool kSplit>
__global__ void __launch_bounds__(32 * kWarps)
    DenseGemvKernel(Jobs jobs, int T, int in, int chunk) {
  exl3::cuda::PdlEnter();
  using Unit = typename std::conditional<kVector, float4, float>::type;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int units = kVector ? in / 4 : in;
  int splits = 1, part = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kSplit) {
    splits = static_cast<int>(cg::this_cluster().num_blocks());
    part = static_cast<int>(cg::this_cluster().block_rank());
  }
#endif
  const int tile = blockIdx.x / splits;
  int j = 0, o = 0;
  const bool active = Locate(jobs, tile * kWarps + warp, &j, &o);
  float acc[kRows] = {};
  if (active) {
    const DenseGemvJob& job = jobs.job[j];
    const int begin = part * chunk, end = min(units, begin + chunk);
    SliceDots<kRows>(reinterpret_cast<const Unit*>(job.weight + static_cast<size_t>(o) * in),
                     reinterpret_cast<const Unit*>(job.x), units, T, begin, end, acc);
  }
  if constexpr (!kSplit) {
    if (active && lane == 0) {
      const DenseGemvJob& job = jobs.job[j];
      const float b = job.bias != nullptr ? job.bias[o] : 0.0f;
#pragma unroll
      for (int t = 0; t < kRows; ++t) {
        if (t < T) job.y[static_cast<size_t>(t) * job.out_features + o] = acc[t] + b;
      }
    }
  } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    __shared__ float sums[kWarps * kRows];
    if (lane == 0) {
#pragma unroll
      for (int t = 0; t < kRows; ++t) sums[warp * kRows + t] = acc[t];
    }
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();  // every block's sums written
    const int e = threadIdx.x, t = e % kRows;
    int je = 0, oe = 0;
    if (e < kWarps * kRows && e % splits == part && t < T && Locate(jobs, tile * kWarps + e / kRows, &je, &oe)) {
      float v = 0.0f;
      for (int r = 0; r < splits; ++r) v += cluster.map_shared_rank(sums, r)[e];
      const DenseGemvJob& job = jobs.job[je];
      const float b = job.bias != nullptr ? job.bias[oe] : 0.0f;
      job.y[static_cast<size_t>(t) * job.out_features + oe] = v + b;
    }
    cluster.sync();  // no block leaves while another still reads its sums
#endif
  }
}

// Narrow inputs (at most 32 units: in ≤ 128 on float4s, ≤ 32 floats else; KDA's f_b / g_b):
// grid ceil(total / (kWarps · kNarrowOutputs)) blocks, block 32 · kWarps. Warp w of block b
// computes outputs (b · kWarps + w) · kNarrowOutputs + r, r < kNarrowOutputs, of the launch (job
// j_r, feature o_r: Locate) for every row t < T ≤ kRows, lane l taking unit l of each row, so that
// a lane has kNarrowOutputs weight loads in flight (one output a warp would leave it one):
//   y_j [T, out_j] fp32 = x_j [T, in] fp32 · W_j [out_j, in]ᵀ fp32 (+ bias_j [out_j] fp32).
template <int kRows, bool kVector>
__global__ void __launch_bounds__(32 * kWarps)
    DenseGemvNarrowKernel(Jobs jobs, int T, int in) {
  exl3::cuda::PdlEnter();
  using Unit = typename std::conditional<kVector, float4, float>::type;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int units = kVector ? in / 4 : in;
  const int first = (blockIdx.x * kWarps + warp) * kNarrowOutputs;
  Unit wv[kNarrowOutputs];
  int jo[kNarrowOutputs], oo[kNarrowOutputs];
  bool act[kNarrowOutputs];
#pragma unroll
  for (int r = 0; r < kNarrowOutputs; ++r) {
    act[r] = Locate(jobs, first + r, &jo[r], &oo[r]);
    Zero(&wv[r]);
    if (act[r] && lane < units)
      wv[r] = Load(reinterpret_cast<const Unit*>(jobs.job[jo[r]].weight + static_cast<size_t>(oo[r]) * in) + lane);
  }
  float acc[kNarrowOutputs][kRows] = {};
#pragma unroll
  for (int r = 0; r < kNarrowOutputs; ++r) {
    if (act[r] && lane < units) {
      const Unit* x = reinterpret_cast<const Unit*>(jobs.job[jo[r]].x);
#pragma unroll
      for (int t = 0; t < kRows; ++t) {
        if (t < T) acc[r][t] = Dot(wv[r], Load(x + static_cast<size_t>(t) * units + lane), 0.0f);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kNarrowOutputs; ++r) {
#pragma unroll
    for (int t = 0; t < kRows; ++t) {
      float v = acc[r][t];
      for (int s = 16; s > 0; s >>= 1) v += __shfl_xor_sync(kFullMask, v, s);
      acc[r][t] = v;
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kNarrowOutputs; ++r) {
      if (!act[r]) continue;
      const DenseGemvJob& job = jobs.job[jo[r]];
      const float b = job.bias != nullptr ? job.bias[oo[r]] : 0.0f;
#pragma unroll
      for (int t = 0; t < kRows; ++t) {
        if (t < T) job.y[static_cast<size_t>(t) * job.out_features + oo[r]] = acc[r][t] + b;
      }
    }
  }
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Thread-block clusters (compute capability 9.0 on): asked of the first device that launches here.
bool ClusterLaunch() {
  static const bool supported = [] {
    int device = 0, v = 0;
    return cudaGetDevice(&device) == cudaSuccess &&
           cudaDeviceGetAttribute(&v, cudaDevAttrClusterLaunch, device) == cudaSuccess && v != 0;
  }();
  return supported;
}

int CeilDiv(int a, int b) { return (a + b - 1) / b; }

// Input units one block of a split launch sums (a lane kBatch float4s, or as many bytes of floats).
int SliceUnits(bool vector) { return 32 * kBatch * (vector ? 1 : 4); }

template <int kRows, bool kVector, bool kSplit>
cudaError_t Launch(const Jobs& jobs, int T, int in, int tiles, int splits, int chunk, cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(tiles * splits));
  cfg.blockDim = dim3(32 * kWarps);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  int n = 0;
  if (kSplit) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = static_cast<unsigned>(splits);
    attr[n].val.clusterDim.y = 1;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  if (exl3::cuda::PdlEnabled()) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  return cudaLaunchKernelEx(&cfg, DenseGemvKernel<kRows, kVector, kSplit>, jobs, T, in, chunk);
}

template <int kRows, bool kVector>
cudaError_t LaunchNarrow(const Jobs& jobs, int T, int in, int blocks, cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(blocks));
  cfg.blockDim = dim3(32 * kWarps);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = exl3::cuda::PdlEnabled() ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, DenseGemvNarrowKernel<kRows, kVector>, jobs, T, in);
}

template <int kRows>
cudaError_t LaunchRows(bool vector, const Jobs& jobs, int T, int in, const DenseGemvShape& plan, int tiles,
                       int chunk, cudaStream_t stream) {
  const int splits = plan.splits;
  if (plan.outputs_per_warp > 1) {
    return vector ? LaunchNarrow<kRows, true>(jobs, T, in, plan.blocks, stream)
                  : LaunchNarrow<kRows, false>(jobs, T, in, plan.blocks, stream);
  }
  if (vector) {
    return splits > 1 ? Launch<kRows, true, true>(jobs, T, in, tiles, splits, chunk, stream)
                      : Launch<kRows, true, false>(jobs, T, in, tiles, 1, chunk, stream);
  }
  return splits > 1 ? Launch<kRows, false, true>(jobs, T, in, tiles, splits, chunk, stream)
                    : Launch<kRows, false, false>(jobs, T, in, tiles, 1, chunk, stream);
}

}  // namespace

DenseGemvShape DenseGemvPlan(int out_features, int in_features, bool vector) {
  DenseGemvShape p;
  const int tiles = CeilDiv(out_features, kWarps);
  const int units = vector ? in_features / 4 : in_features;
  if (tiles < 1) return p;
  if (units <= 32) {
    p.outputs_per_warp = kNarrowOutputs;
    p.blocks = CeilDiv(out_features, kWarps * kNarrowOutputs);
    return p;
  }
  p.splits = std::max(1, std::min({CeilDiv(units, SliceUnits(vector)), kMaxSplits, CeilDiv(kFillBlocks, tiles)}));
  p.blocks = tiles * p.splits;
  return p;
}

absl::Status DenseGemv(const DenseGemvJob* jobs, int count, const float* x, int num_tokens, int in_features,
                       StreamHandle stream) {
  if (num_tokens == 0) return absl::OkStatus();
  if (count < 1 || count > kDenseGemvMaxJobs || num_tokens < 0 || num_tokens > kDenseGemvMaxRows ||
      in_features < 1)
    return absl::InvalidArgumentError(absl::StrCat("dense GEMV: ", count, " linears of ", in_features,
                                                   " inputs over ", num_tokens, " rows (at most ",
                                                   kDenseGemvMaxJobs, " and ", kDenseGemvMaxRows, ")"));
  Jobs j{};
  j.count = count;
  bool vector = in_features % 4 == 0;
  for (int i = 0; i < count; ++i) {
    j.job[i] = jobs[i];
    if (j.job[i].x == nullptr) j.job[i].x = x;
    if (j.job[i].x == nullptr)
      return absl::InvalidArgumentError(absl::StrCat("dense GEMV: linear ", i, " has no input"));
    j.first[i + 1] = j.first[i] + std::max(0, jobs[i].out_features);
    vector = vector && Aligned16(j.job[i].weight) && Aligned16(j.job[i].x);
  }
  const int total = j.first[count];
  if (total == 0) return absl::OkStatus();
  DenseGemvShape plan = DenseGemvPlan(total, in_features, vector);
  if (plan.splits > 1 && !ClusterLaunch()) {
    plan.splits = 1;
    plan.blocks = CeilDiv(total, kWarps);
  }
  const int tiles = CeilDiv(total, kWarps);
  const int units = vector ? in_features / 4 : in_features;
  const int chunk = plan.splits == 1 ? units : CeilDiv(CeilDiv(units, plan.splits), 32) * 32;
  const cudaStream_t s = S(stream);
  const int T = num_tokens;
  const cudaError_t err =
      T <= 1   ? LaunchRows<1>(vector, j, T, in_features, plan, tiles, chunk, s)
      : T <= 2 ? LaunchRows<2>(vector, j, T, in_features, plan, tiles, chunk, s)
      : T <= 4 ? LaunchRows<4>(vector, j, T, in_features, plan, tiles, chunk, s)
               : LaunchRows<kDenseGemvMaxRows>(vector, j, T, in_features, plan, tiles, chunk, s);
  if (err != cudaSuccess) return exl3::cuda::CudaStatus(err, "dense GEMV", __FILE__, __LINE__);
  return LaunchStatus("dense GEMV");
}

}  // namespace exl3::engine::cuda
