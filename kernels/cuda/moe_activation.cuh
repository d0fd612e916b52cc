// The MoE experts' activation on the GPU, shared by the launch chain's MoeMidKernel
// (moe_kernels.cu) and the cooperative decode kernel (moe_cooperative.cu):
//   silu(g) * u, with the clamped SwiGLU variant (limit > 0): g <= limit, -limit <= u <= limit.
#pragma once

namespace exl3::cuda {

__device__ __forceinline__ float SiluMul(float g, float u, float limit) {
  if (limit > 0.f) {
    g = fminf(g, limit);
    u = fminf(fmaxf(u, -limit), limit);
  }
  return g / (1.f + expf(-g)) * u;
}

}  // namespace exl3::cuda
