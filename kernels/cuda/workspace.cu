// DeviceBuffer and Workspace (workspace.h).
#include "kernels/cuda/workspace.h"

#include "kernels/cuda/cuda_status.h"

namespace exl3::cuda {

absl::Status DeviceBuffer::Reserve(size_t want) {
  if (want <= bytes) return absl::OkStatus();
  if (ptr) cudaFree(ptr);
  ptr = nullptr;
  bytes = 0;
  EXL3_CUDA_RETURN_IF_ERROR(cudaMalloc(&ptr, want));
  bytes = want;
  ++allocations;
  return absl::OkStatus();
}
absl::Status DeviceBuffer::ReserveZeroed(size_t want, cudaStream_t stream) {
  if (want <= bytes) return absl::OkStatus();
  EXL3_RETURN_IF_ERROR(Reserve(want));
  EXL3_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(ptr, 0, bytes, stream));
  return absl::OkStatus();
}
DeviceBuffer::~DeviceBuffer() {
  if (ptr) cudaFree(ptr);
}

Workspace::Workspace() : impl_(std::make_unique<Impl>()) {}
Workspace::~Workspace() = default;
uint64_t Workspace::allocations() const {
  return impl_->a.allocations + impl_->dequant.allocations + impl_->gemv_acc.allocations +
         impl_->gemv_arrivals.allocations;
}
Workspace::Impl::~Impl() {
  if (cublas) cublasDestroy(cublas);
}
absl::Status Workspace::Impl::Init() {
  if (device >= 0) return absl::OkStatus();
  int dev = 0;
  EXL3_CUDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
  EXL3_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, dev));
  EXL3_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, dev));
  device = dev;
  return absl::OkStatus();
}

}  // namespace exl3::cuda
