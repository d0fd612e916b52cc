// What every launch of one CUDA model shares: its non-blocking stream, the cuBLAS handle bound to
// it (with a workspace of its own, so cuBLAS allocates nothing while a decode graph is captured),
// the EXL3 kernels' workspace and the device's SM count.
//
//   EXL3_ASSIGN_OR_RETURN(std::unique_ptr<DeviceContext> device, DeviceContext::Create());
//   EXL3_RETURN_IF_ERROR(layer.Forward(x, T, y, device->linear()));
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "engine/cuda/cuda_linear.h"
#include "engine/cuda/device_array.h"

namespace exl3::engine::cuda {

class DeviceContext {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceContext>> Create();
  ~DeviceContext();  // waits for the stream's work
  DeviceContext(const DeviceContext&) = delete;
  DeviceContext& operator=(const DeviceContext&) = delete;

  StreamHandle stream() const { return stream_; }
  const CudaLinearContext& linear() const { return linear_; }
  exl3::cuda::Workspace& workspace() { return workspace_; }
  int sm_count() const { return sm_count_; }
  absl::Status Synchronize() const;

 private:
  DeviceContext() = default;

  StreamHandle stream_ = nullptr;  // cudaStream_t
  void* cublas_ = nullptr;         // cublasHandle_t
  DeviceArray<uint8_t> cublas_workspace_;
  exl3::cuda::Workspace workspace_;
  CudaLinearContext linear_;
  int sm_count_ = 0;
};

}  // namespace exl3::engine::cuda
