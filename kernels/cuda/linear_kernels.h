// Launchers of the dense path's small transform kernels (transform_kernels.cuh); RunEmptyLaunch
// (bench_hooks.h) is defined beside them.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace exl3::cuda {

// A[rows, k] fp16 = (x ⊙ suh) · H; also zeroes zero_y [rows, zero_n] when it is not null.
absl::Status LaunchInputTransform(const float* x, int rows, int k, const uint16_t* suh, __half* a,
                                  float* zero_y, int zero_n, cudaStream_t stream);
// y[rows, n] = (y · H) ⊙ svh (+ bias), in place.
absl::Status LaunchOutputTransform(float* y, int rows, int n, const uint16_t* svh, const uint16_t* bias,
                                   cudaStream_t stream);

}  // namespace exl3::cuda
