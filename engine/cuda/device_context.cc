#include "engine/cuda/device_context.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "base/status_macros.h"
#include "engine/cuda/cublas_status.h"
#include "kernels/cuda/cuda_status.h"

namespace exl3::engine::cuda {

absl::StatusOr<std::unique_ptr<DeviceContext>> DeviceContext::Create() {
  std::unique_ptr<DeviceContext> d(new DeviceContext());
  cudaStream_t stream;
  EXL3_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  d->stream_ = stream;
  cublasHandle_t handle;
  EXL3_RETURN_IF_ERROR(CublasStatus(cublasCreate(&handle), "cublasCreate"));
  d->cublas_ = handle;
  EXL3_RETURN_IF_ERROR(CublasStatus(cublasSetStream(handle, stream), "cublasSetStream"));
  constexpr size_t kCublasWorkspace = 32 << 20;
  EXL3_RETURN_IF_ERROR(d->cublas_workspace_.Reserve(kCublasWorkspace));
  EXL3_RETURN_IF_ERROR(CublasStatus(cublasSetWorkspace(handle, d->cublas_workspace_.get(), kCublasWorkspace),
                                    "cublasSetWorkspace"));
  d->linear_ = CudaLinearContext{d->cublas_, &d->workspace_, d->stream_};
  int dev = 0;
  EXL3_CUDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
  EXL3_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&d->sm_count_, cudaDevAttrMultiProcessorCount, dev));
  return d;
}

DeviceContext::~DeviceContext() {
  if (stream_ != nullptr) cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
  if (cublas_ != nullptr) cublasDestroy(static_cast<cublasHandle_t>(cublas_));
  if (stream_ != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

absl::Status DeviceContext::Synchronize() const {
  EXL3_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)));
  return absl::OkStatus();
}

}  // namespace exl3::engine::cuda
