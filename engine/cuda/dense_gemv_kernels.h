// Decode-sized dense (fp32) linears on the GPU: y [T, out] = x [T, in] · Wᵀ (+ b) for at most
// kDenseGemvMaxRows rows, where cuBLAS's GEMV and split-K GEMM spend two launches and a few
// microseconds each on shapes like GLM-5.3-Flash's 4096 → 128 low-rank projections. A block of
// eight warps takes eight output features, a warp one of them, its lanes reading the weight row in
// float4s (where aligned) a few loads ahead against every row of x (rows of at most 32 loads, as
// KDA's 128 → 8192 f_b / g_b: four features a warp, a load of each in flight). Where the outputs alone would
// leave the GPU mostly idle (a few hundred features of 4096 inputs: 40 blocks), the input
// dimension is split over a cluster of up to 8 blocks (sm_90), each summing its slice; the slices'
// sums are added in block order through distributed shared memory, so the result does not depend
// on scheduling. Up to kDenseGemvMaxJobs linears of the same input width go in one launch, on one
// shared x or each on its own.
// Host launcher only: no CUDA header here; every pointer is device memory.
#pragma once

#include "absl/status/status.h"
#include "engine/cuda/device_array.h"  // StreamHandle

namespace exl3::engine::cuda {

inline constexpr int kDenseGemvMaxRows = 8;
inline constexpr int kDenseGemvMaxJobs = 4;

// One linear: weight [out_features, in] fp32 row-major, bias [out_features] fp32 or null, y
// [T, out_features] fp32; x [T, in] fp32 of its own, or null for the launch's shared x.
struct DenseGemvJob {
  const float* weight = nullptr;
  const float* bias = nullptr;
  float* y = nullptr;
  int out_features = 0;
  const float* x = nullptr;
};

// y of every job from x [num_tokens, in_features] fp32 (or the job's own x); 1 ≤ count ≤
// kDenseGemvMaxJobs, num_tokens ≤ kDenseGemvMaxRows (0 does nothing). x may be null when every
// job has its own.
absl::Status DenseGemv(const DenseGemvJob* jobs, int count, const float* x, int num_tokens, int in_features,
                       StreamHandle stream);

// How DenseGemv lays out a launch of `out_features` outputs (summed over its jobs) of
// `in_features` inputs (`vector`: on float4s) on a device with clusters: its blocks, the input
// slices an output tile is split over (1: no split, no cluster), and outputs a warp computes (more
// than one where a row is at most 32 loads wide). For the kernel test and a profile's reading.
struct DenseGemvShape {
  int blocks = 0;
  int splits = 1;
  int outputs_per_warp = 1;
};
DenseGemvShape DenseGemvPlan(int out_features, int in_features, bool vector);

}  // namespace exl3::engine::cuda
