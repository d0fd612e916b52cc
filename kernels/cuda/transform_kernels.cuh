// Input/output transforms of an EXL3 linear layer on the GPU:
//   input:  A[r] = fp16( (x[r] ⊙ suh) · H )      x fp32 [rows, k], suh fp16 [k], A fp16 [rows, k]
//   output: y[r] = (y'[r] · H) ⊙ svh (+ bias)    y fp32 [rows, n] in place, svh/bias fp16 [n]
// H = block-diagonal Hadamard-128 / sqrt(128). One warp per 128-block.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/cuda/hadamard.cuh"

namespace exl3::cuda {

__device__ __forceinline__ float HalfAt(const uint16_t* p, int i) {
  return __half2float(__ushort_as_half(p[i]));
}

// The two halves of InputBlock, for callers that batch the loads of several blocks:
// v = x ⊙ suh (element 32r + lane), then out = fp16(v · H).
__device__ __forceinline__ void InputLoad(const float* x, const uint16_t* suh, float (&v)[4], int lane) {
#pragma unroll
  for (int r = 0; r < 4; ++r) v[r] = x[32 * r + lane] * HalfAt(suh, 32 * r + lane);
}
__device__ __forceinline__ void InputFinish(float (&v)[4], __half* out, int lane) {
  WarpHadamard128(v, lane);
#pragma unroll
  for (int r = 0; r < 4; ++r) out[32 * r + lane] = __float2half_rn(v[r]);
}

// Transforms one 128-block: x (fp32, 128) ⊙ suh (fp16) · H -> out (fp16). Warp-cooperative.
__device__ __forceinline__ void InputBlock(const float* x, const uint16_t* suh, __half* out, int lane) {
  float v[4];
  InputLoad(x, suh, v, lane);
  InputFinish(v, out, lane);
}

// v (element 32r + lane of a y' block, fp32) -> (v · H) ⊙ svh (+ bias), in place. The scales are
// loaded before the Hadamard so that their latency overlaps it.
__device__ __forceinline__ void OutputValues(float (&v)[4], const uint16_t* svh, const uint16_t* bias, int lane) {
  float sv[4], bv[4];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    sv[r] = HalfAt(svh, 32 * r + lane);
    bv[r] = bias ? HalfAt(bias, 32 * r + lane) : 0.f;
  }
  WarpHadamard128(v, lane);
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    v[r] *= sv[r];
    if (bias) v[r] += bv[r];
  }
}

// y' block (fp32) -> (y' · H) ⊙ svh (+ bias), returned in v (element 32r + lane).
__device__ __forceinline__ void OutputBlock(const float* y, const uint16_t* svh, const uint16_t* bias,
                                            float (&v)[4], int lane) {
#pragma unroll
  for (int r = 0; r < 4; ++r) v[r] = y[32 * r + lane];
  OutputValues(v, svh, bias, lane);
}

}  // namespace exl3::cuda
