// The dense path's transform kernels and their launchers (linear_kernels.h), and exl3-bench's
// empty launch (bench_hooks.h).
#include "kernels/cuda/linear_kernels.h"

#include "kernels/cuda/bench_hooks.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/transform_kernels.cuh"

namespace exl3::cuda {

// One warp per (row, 128-block); 4 warps per block. Also zeroes zero_y [rows, zero_n] (grid-stride)
// for the atomically accumulating GEMV that follows.
__global__ void __launch_bounds__(128) InputTransformKernel(const float* __restrict__ x, int rows, int k,
                                                            const uint16_t* __restrict__ suh, __half* __restrict__ a,
                                                            float* __restrict__ zero_y, int zero_n) {
  PdlEnter();
  const int lane = threadIdx.x & 31;
  const int w = blockIdx.x * 4 + (threadIdx.x >> 5);
  const int per_row = k / 128;
  if (w < rows * per_row) {
    const int row = w / per_row, b = w % per_row;
    InputBlock(x + static_cast<size_t>(row) * k + 128 * b, suh + 128 * b,
               a + static_cast<size_t>(row) * k + 128 * b, lane);
  }
  if (zero_y) {
    const size_t total = static_cast<size_t>(rows) * zero_n / 4;  // float4s (n % 128 == 0)
    for (size_t i = static_cast<size_t>(blockIdx.x) * 128 + threadIdx.x; i < total; i += gridDim.x * 128ul)
      reinterpret_cast<float4*>(zero_y)[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

__global__ void __launch_bounds__(128) OutputTransformKernel(float* __restrict__ y, int rows, int n,
                                                             const uint16_t* __restrict__ svh,
                                                             const uint16_t* __restrict__ bias) {
  PdlEnter();
  const int lane = threadIdx.x & 31;
  const int w = blockIdx.x * 4 + (threadIdx.x >> 5);
  const int per_row = n / 128;
  if (w >= rows * per_row) return;
  const int row = w / per_row, b = w % per_row;
  float* p = y + static_cast<size_t>(row) * n + 128 * b;
  float v[4];
  OutputBlock(p, svh + 128 * b, bias ? bias + 128 * b : nullptr, v, lane);
#pragma unroll
  for (int r = 0; r < 4; ++r) p[32 * r + lane] = v[r];
}

// exl3-bench's launch floor: a kernel that only takes part in the PDL sequence.
__global__ void __launch_bounds__(256) EmptyPdlKernel() { PdlEnter(); }

absl::Status RunEmptyLaunch(int grid, StreamHandle stream) {
  LaunchPdl(EmptyPdlKernel, dim3(grid), dim3(256), static_cast<cudaStream_t>(stream));
  EXL3_CUDA_CHECK_LAUNCH("EmptyPdlKernel");
  return absl::OkStatus();
}

absl::Status LaunchInputTransform(const float* x, int rows, int k, const uint16_t* suh, __half* a,
                                  float* zero_y, int zero_n, cudaStream_t stream) {
  if (rows == 0) return absl::OkStatus();
  const int blocks = (rows * (k / 128) + 3) / 4;
  LaunchPdl(InputTransformKernel, dim3(blocks), dim3(128), stream, x, rows, k, suh, a, zero_y, zero_n);
  EXL3_CUDA_CHECK_LAUNCH("InputTransformKernel");
  return absl::OkStatus();
}

absl::Status LaunchOutputTransform(float* y, int rows, int n, const uint16_t* svh, const uint16_t* bias,
                                   cudaStream_t stream) {
  if (rows == 0) return absl::OkStatus();
  const int blocks = (rows * (n / 128) + 3) / 4;
  LaunchPdl(OutputTransformKernel, dim3(blocks), dim3(128), stream, y, rows, n, svh, bias);
  EXL3_CUDA_CHECK_LAUNCH("OutputTransformKernel");
  return absl::OkStatus();
}

}  // namespace exl3::cuda
