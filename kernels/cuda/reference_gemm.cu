// ReferenceGemm (reference_gemm.h).
#include "kernels/cuda/reference_gemm.h"

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/gemv_plan.h"
#include "kernels/cuda/kernel_dispatch.h"

namespace exl3::cuda {

absl::Status CublasStatus(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("cuBLAS error ", static_cast<int>(s), " in ", what));
}

absl::Status ReferenceGemm(cublasHandle_t h, const uint16_t* trellis, int k, int n, int K, int cb,
                           const __half* a, int rows, float* y, uint16_t* scratch, cudaStream_t stream) {
  EXL3_RETURN_IF_ERROR(DispatchDequant(K, cb, trellis, k, n, scratch, kDequantGrid, stream));
  EXL3_CUDA_CHECK_LAUNCH("DequantKernel");
  EXL3_RETURN_IF_ERROR(CublasStatus(cublasSetStream(h, stream), "cublasSetStream"));
  const float alpha = 1.f, beta = 0.f;
  // Row-major y[rows, n] = A[rows, k] · W[k, n]  <=>  column-major y^T = W^T · A^T.
  return CublasStatus(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, rows, k, &alpha, scratch, CUDA_R_16F, n,
                                   a, CUDA_R_16F, k, &beta, y, CUDA_R_32F, n, CUBLAS_COMPUTE_32F,
                                   CUBLAS_GEMM_DEFAULT),
                      "cublasGemmEx");
}

}  // namespace exl3::cuda
