// What the engine's kernel files (engine_kernels.cu, attention_kernels.cu) share around a launch:
// the stream handle as a cudaStream_t, and the launch's error as an absl::Status.
#pragma once

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_status.h"

namespace exl3::engine::cuda {

using StreamHandle = void*;  // cudaStream_t, as the kernel headers declare it

inline cudaStream_t S(StreamHandle s) { return static_cast<cudaStream_t>(s); }

// The error of the last launch (cudaGetLastError), named by `what`.
inline absl::Status LaunchStatus(const char* what) {
  return exl3::cuda::CudaStatus(cudaGetLastError(), what, __FILE__, __LINE__);
}

}  // namespace exl3::engine::cuda
