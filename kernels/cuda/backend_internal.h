// Internals shared by the backend's host files (linear.cu, moe.cu, the bench and check tools).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/gemv_kernel.cuh"

namespace exl3::cuda {

// Grows a device buffer to at least `bytes` (never shrinks).
struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
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

absl::Status CublasStatus(cublasStatus_t s, const char* what);

// Resolves kAuto through EXL3_MOE_KERNEL and the device (cc < 8 -> reference); logs the choice
// once per process and `what`.
Path ResolvePath(Path requested, int cc_major, const char* what);

// Rows at or below which the native path uses the 16-row GEMV rather than the prefill GEMM.
inline constexpr int kGemvMaxRows = 48;

// Picks the k-slice length for a GEMV problem so that about `target_units` warp units exist.
int GemvKTilesPerUnit(int k, int n, int chunks, int sm_count);
int GemvGrid(int sm_count);
// k-slice length (16-row tiles) of the one-launch GEMV (dense_gemv_kernel.cuh) at bit width K for
// chunks of `rows` rows (<= 8), `base_units` (row chunks x 128-column blocks) over k/16 tiles on
// sm_count SMs.
int DenseGemvSliceTiles(int K, int rows, int k_tiles, long base_units, int sm_count);
int GemmGrid(int sm_count, long units);

// Reference GEMM on one expert/linear: y[rows, n] (+)= A[rows, k] fp16 · W_inner (dequantised into
// `scratch`, fp16 [k, n]). beta 0 overwrites, 1 accumulates.
absl::Status ReferenceGemm(cublasHandle_t h, const uint16_t* trellis, int k, int n, int K, int cb,
                           const __half* a, int rows, float* y, uint16_t* scratch, cudaStream_t stream);

// Launchers of the small transform kernels (linear.cu).
absl::Status LaunchInputTransform(const float* x, int rows, int k, const uint16_t* suh, __half* a,
                                  float* zero_y, int zero_n, cudaStream_t stream);
absl::Status LaunchOutputTransform(float* y, int rows, int n, const uint16_t* svh, const uint16_t* bias,
                                   cudaStream_t stream);

}  // namespace exl3::cuda
