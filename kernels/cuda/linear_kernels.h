// Launchers of the dense path's small transform kernels (transform_kernels.cuh); RunEmptyLaunch
// (bench_hooks.h) is defined beside them.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace exl3::cuda {

// Several layers' transforms in one launch (the layers of one input: LinearForwardShared).
inline constexpr int kMaxTransformJobs = 4;
struct InputTransformJob {
  const uint16_t* suh;  // [k] fp16
  __half* a;            // [rows, k] fp16 out
  float* zero_y;        // [rows, zero_n] zeroed, or null
  int zero_n;
};
struct InputTransformJobs {
  InputTransformJob job[kMaxTransformJobs];
  int count = 0;
};
struct OutputTransformJob {
  float* y;              // [rows, n] fp32, in place
  int n;
  const uint16_t* svh;   // [n] fp16
  const uint16_t* bias;  // [n] fp16, or null
};
struct OutputTransformJobs {
  OutputTransformJob job[kMaxTransformJobs];
  int count = 0;
};
// Per job: A[rows, k] fp16 = (x ⊙ suh) · H, zeroing zero_y. x [rows, k] fp32.
absl::Status LaunchInputTransforms(const float* x, int rows, int k, const InputTransformJobs& jobs,
                                   cudaStream_t stream);
// Per job: y = (y · H) ⊙ svh (+ bias), in place.
absl::Status LaunchOutputTransforms(int rows, const OutputTransformJobs& jobs, cudaStream_t stream);

// A[rows, k] fp16 = (x ⊙ suh) · H; also zeroes zero_y [rows, zero_n] when it is not null.
absl::Status LaunchInputTransform(const float* x, int rows, int k, const uint16_t* suh, __half* a,
                                  float* zero_y, int zero_n, cudaStream_t stream);
// y[rows, n] = (y · H) ⊙ svh (+ bias), in place.
absl::Status LaunchOutputTransform(float* y, int rows, int n, const uint16_t* svh, const uint16_t* bias,
                                   cudaStream_t stream);

}  // namespace exl3::cuda
