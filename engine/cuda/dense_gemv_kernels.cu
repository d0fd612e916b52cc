#include "engine/cuda/dense_gemv_kernels.h"

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "engine/cuda/launch_status.cuh"

namespace exl3::engine::cuda {
namespace {

constexpr int kWarps = 8;
constexpr unsigned kFullMask = 0xffffffffu;

struct Jobs {
  DenseGemvJob job[kDenseGemvMaxJobs];
  int first_warp[kDenseGemvMaxJobs + 1];  // job j's output features are warps [first_warp[j], first_warp[j + 1])
  int count;
};

// grid ceil(total outputs / kWarps), block 32 · kWarps: warp w computes output feature w − first_warp[j] of the
// job j it falls in, for every row of x. kVector: in % 4 == 0 and x and every weight 16-byte aligned.
template <bool kVector>
__global__ void __launch_bounds__(32 * kWarps)
    DenseGemvKernel(Jobs jobs, const float* __restrict__ x, int T, int in) {
  const int warp = blockIdx.x * kWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  int j = 0;
  while (j < jobs.count && warp >= jobs.first_warp[j + 1]) ++j;
  if (j == jobs.count) return;
  const DenseGemvJob& job = jobs.job[j];
  const int o = warp - jobs.first_warp[j];
  const float* w = job.weight + static_cast<size_t>(o) * in;
  float acc[kDenseGemvMaxRows] = {};
  if (kVector) {
    const int in4 = in / 4;
    const float4* w4 = reinterpret_cast<const float4*>(w);
    const float4* x4 = reinterpret_cast<const float4*>(x);
    for (int i = lane; i < in4; i += 32) {
      const float4 wv = __ldg(w4 + i);
#pragma unroll
      for (int t = 0; t < kDenseGemvMaxRows; ++t) {
        if (t < T) {
          const float4 xv = __ldg(x4 + static_cast<size_t>(t) * in4 + i);
          acc[t] = fmaf(wv.x, xv.x, fmaf(wv.y, xv.y, fmaf(wv.z, xv.z, fmaf(wv.w, xv.w, acc[t]))));
        }
      }
    }
  } else {
    for (int i = lane; i < in; i += 32) {
      const float wv = __ldg(w + i);
#pragma unroll
      for (int t = 0; t < kDenseGemvMaxRows; ++t) {
        if (t < T) acc[t] = fmaf(wv, __ldg(x + static_cast<size_t>(t) * in + i), acc[t]);
      }
    }
  }
  const float b = job.bias != nullptr ? job.bias[o] : 0.0f;
#pragma unroll
  for (int t = 0; t < kDenseGemvMaxRows; ++t) {
    if (t < T) {
      float v = acc[t];
      for (int s = 16; s > 0; s >>= 1) v += __shfl_xor_sync(kFullMask, v, s);
      if (lane == 0) job.y[static_cast<size_t>(t) * job.out_features + o] = v + b;
    }
  }
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

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
  bool vector = in_features % 4 == 0 && Aligned16(x);
  for (int i = 0; i < count; ++i) {
    j.job[i] = jobs[i];
    j.first_warp[i + 1] = j.first_warp[i] + jobs[i].out_features;
    vector = vector && Aligned16(jobs[i].weight);
  }
  const unsigned blocks = static_cast<unsigned>((j.first_warp[count] + kWarps - 1) / kWarps);
  if (blocks == 0) return absl::OkStatus();
  if (vector) {
    DenseGemvKernel<true><<<blocks, 32 * kWarps, 0, S(stream)>>>(j, x, num_tokens, in_features);
  } else {
    DenseGemvKernel<false><<<blocks, 32 * kWarps, 0, S(stream)>>>(j, x, num_tokens, in_features);
  }
  return LaunchStatus("dense GEMV");
}

}  // namespace exl3::engine::cuda
