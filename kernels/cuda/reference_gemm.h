// The reference path's GEMM: W_inner dequantised to fp16 on the device, then cuBLAS.
#pragma once

#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace exl3::cuda {

absl::Status CublasStatus(cublasStatus_t s, const char* what);

// Reference GEMM on one expert/linear: y[rows, n] = A[rows, k] fp16 · W_inner (dequantised into
// `scratch`, fp16 [k, n]); y is overwritten.
absl::Status ReferenceGemm(cublasHandle_t h, const uint16_t* trellis, int k, int n, int K, int cb,
                           const __half* a, int rows, float* y, uint16_t* scratch, cudaStream_t stream);

}  // namespace exl3::cuda
