// Warp-level Hadamard-128 (orthonormal, Sylvester natural order) on the GPU.
#pragma once

namespace exl3::cuda {

// v[r] holds element 32r + lane of a 128-block. In place: v <- v · H128 / sqrt(128).
__device__ __forceinline__ void WarpHadamard128(float (&v)[4], int lane) {
#pragma unroll
  for (int h = 1; h < 32; h <<= 1) {
    const bool upper = lane & h;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float o = __shfl_xor_sync(0xffffffffu, v[r], h);
      v[r] = upper ? (o - v[r]) : (v[r] + o);
    }
  }
  // Strides 32 and 64: across the register index.
  float a0 = v[0] + v[1], a1 = v[0] - v[1], a2 = v[2] + v[3], a3 = v[2] - v[3];
  const float s = 0.08838834764831845f;  // 1/sqrt(128)
  v[0] = (a0 + a2) * s;
  v[1] = (a1 + a3) * s;
  v[2] = (a0 - a2) * s;
  v[3] = (a1 - a3) * s;
}

}  // namespace exl3::cuda
