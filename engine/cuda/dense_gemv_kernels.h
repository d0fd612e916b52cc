// Decode-sized dense (fp32) linears on the GPU: y [T, out] = x [T, in] · Wᵀ (+ b) for at most
// kDenseGemvMaxRows rows, where cuBLAS's GEMV and split-K GEMM spend two launches and a few
// microseconds each on shapes like GLM-5.3-Flash's 4096 → 128 low-rank projections. One warp per
// output feature reads its weight row once (float4s where aligned) against every row of x; the
// sums end in warp shuffles. Up to kDenseGemvMaxJobs linears that share x go in one launch.
// Host launcher only: no CUDA header here; every pointer is device memory.
#pragma once

#include "absl/status/status.h"
#include "engine/cuda/device_array.h"  // StreamHandle

namespace exl3::engine::cuda {

inline constexpr int kDenseGemvMaxRows = 8;
inline constexpr int kDenseGemvMaxJobs = 4;

// One linear: weight [out_features, in] fp32 row-major, bias [out_features] fp32 or null, y
// [T, out_features] fp32.
struct DenseGemvJob {
  const float* weight = nullptr;
  const float* bias = nullptr;
  float* y = nullptr;
  int out_features = 0;
};

// y of every job from x [num_tokens, in_features] fp32; 1 ≤ count ≤ kDenseGemvMaxJobs,
// num_tokens ≤ kDenseGemvMaxRows (0 does nothing).
absl::Status DenseGemv(const DenseGemvJob* jobs, int count, const float* x, int num_tokens, int in_features,
                       StreamHandle stream);

}  // namespace exl3::engine::cuda
