// Growable device buffers and the dense path's scratch memory (cuda_backend.h's Workspace).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_backend.h"

namespace exl3::cuda {

// Grows a device buffer to at least `bytes` (never shrinks).
struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  uint64_t allocations = 0;  // times Reserve allocated
  absl::Status Reserve(size_t want);
  // Reserve, and a newly allocated buffer is zeroed (on `stream`).
  absl::Status ReserveZeroed(size_t want, cudaStream_t stream);
  ~DeviceBuffer();
};

struct Workspace::Impl {
  DeviceBuffer a;        // fp16 transformed input
  DeviceBuffer dequant;  // fp16 W_inner (reference path)
  // The one-launch GEMV's accumulator and arrival counts (dense_gemv_kernel.cuh): zeroed when
  // allocated, left zero by every launch.
  DeviceBuffer gemv_acc;
  DeviceBuffer gemv_arrivals;
  cublasHandle_t cublas = nullptr;
  int device = -1;
  int sm_count = 0;
  int cc_major = 0;
  ~Impl();
  absl::Status Init();
};

}  // namespace exl3::cuda
