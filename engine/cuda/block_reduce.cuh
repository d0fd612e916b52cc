// Block-wide reductions shared by the GPU engine's kernels.
#pragma once

namespace exl3::engine::cuda {

// Sum over the block of a double held by every thread (blockDim.x a multiple of 32, every thread
// calling); `partial` [32] in shared memory, reusable by the next call.
__device__ inline double BlockSumDouble(double v, double* partial) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // partial may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  double total = 0.0;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) total += partial[w];
  return total;
}

}  // namespace exl3::engine::cuda
