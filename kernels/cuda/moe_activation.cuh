// The MoE experts' activation on the GPU, shared by the launch chain's MoeMidKernel
// (moe_kernels.cu) and the cooperative decode kernel (moe_cooperative.cu):
//   silu(g) * u, with the clamped SwiGLU variant (limit > 0): g <= limit, -limit <= u <= limit.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/cuda/transform_kernels.cuh"

namespace exl3::cuda {

__device__ __forceinline__ float SiluMul(float g, float u, float limit) {
  if (limit > 0.f) {
    g = fminf(g, limit);
    u = fminf(fmaxf(u, -limit), limit);
  }
  return g / (1.f + expf(-g)) * u;
}

// One warp, one 128-column block `blk` of one row: the gate and up outputs' output transforms
// (svh, bias: null where the projection has none), the activation, then down's input transform
// (suh_down, the Hadamard), written as fp16 to ad. yg, yu, ad point at the row's block.
__device__ __forceinline__ void ActivateBlock(const float* yg, const float* yu, const uint16_t* svh_g,
                                              const uint16_t* bias_g, const uint16_t* svh_u, const uint16_t* bias_u,
                                              const uint16_t* suh_down, float limit, __half* ad, int lane) {
  float g[4], u[4], h[4];
  OutputBlock(yg, svh_g, bias_g, g, lane);
  OutputBlock(yu, svh_u, bias_u, u, lane);
#pragma unroll
  for (int q = 0; q < 4; ++q) h[q] = SiluMul(g[q], u[q], limit) * HalfAt(suh_down, 32 * q + lane);
  WarpHadamard128(h, lane);
#pragma unroll
  for (int q = 0; q < 4; ++q) ad[32 * q + lane] = __float2half_rn(h[q]);
}

}  // namespace exl3::cuda
