// CUDA error -> absl::Status, for the backend's host code (includes CUDA headers: .cu/.cc of the
// backend only).
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"  // EXL3_RETURN_IF_ERROR, used with the CUDA macros below

namespace exl3::cuda {

inline absl::Status CudaStatus(cudaError_t e, const char* what, const char* file, int line) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("CUDA error ", std::string(cudaGetErrorName(e)), " (",
                                          std::string(cudaGetErrorString(e)), ") in ", what, " at ",
                                          file, ":", line));
}

}  // namespace exl3::cuda

#define EXL3_CUDA_RETURN_IF_ERROR(expr)                                                 \
  do {                                                                                  \
    const cudaError_t exl3_cuda_err_ = (expr);                                          \
    if (exl3_cuda_err_ != cudaSuccess)                                                  \
      return ::exl3::cuda::CudaStatus(exl3_cuda_err_, #expr, __FILE__, __LINE__);       \
  } while (0)

// After a kernel launch: reports launch-configuration errors (not asynchronous faults).
#define EXL3_CUDA_CHECK_LAUNCH(name) EXL3_CUDA_RETURN_IF_ERROR(cudaPeekAtLastError())
