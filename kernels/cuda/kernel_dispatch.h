// Template declarations of the per-(K, codebook) launchers (defined in the *_kernel.cuh headers,
// instantiated in inst_k*.cu) and the runtime dispatch over them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/dense_gemv_kernel.cuh"
#include "kernels/cuda/gemv_kernel.cuh"

namespace exl3::cuda {

template <int K, int CB>
void LaunchGroupedGemv(const GemvBatch& batch, int grid, cudaStream_t stream);
template <int K, int CB>
void LaunchDenseGemv(const DenseGemvArgs& args, int grid, cudaStream_t stream);
template <int K, int CB>
void LaunchGroupedGemm(const GemvBatch& batch, int grid, cudaStream_t stream);
template <int K, int CB>
void LaunchDequant(const uint16_t* trellis, int k, int n, uint16_t* out, int grid, cudaStream_t stream);
template <int K, int CB>
void LaunchDecodeCeiling(const uint32_t* seeds, float* out, int iters, int grid, int block,
                         cudaStream_t stream);

// Runtime dispatch on (K, codebook): returns InvalidArgument for K outside 1..8.
absl::Status DispatchGemv(int K, int cb, const GemvBatch& batch, int grid, cudaStream_t stream);
absl::Status DispatchDenseGemv(int K, int cb, const DenseGemvArgs& args, int grid, cudaStream_t stream);
absl::Status DispatchGemm(int K, int cb, const GemvBatch& batch, int grid, cudaStream_t stream);
absl::Status DispatchDequant(int K, int cb, const uint16_t* trellis, int k, int n, uint16_t* out,
                             int grid, cudaStream_t stream);
absl::Status DispatchDecodeCeiling(int K, int cb, const uint32_t* seeds, float* out, int iters,
                                   int grid, int block, cudaStream_t stream);

}  // namespace exl3::cuda
