// Decode ceiling: the GEMV inner loop (lane words -> align -> states -> codebook -> 2 mma per tile)
// with the words already in registers and no memory traffic. Its weights/s is the arithmetic
// limit every decode kernel is judged against. Each iteration decodes 4 tiles (1024 weights per
// warp); the words are advanced by an add so that nothing is loop-invariant.
#pragma once

#include "kernels/cuda/trellis_decode.cuh"

namespace exl3::cuda {

// kFmaShare: DecodeLaneRaw's FMA-pipe share (exl3-decode-share-sweep times every value).
template <int K, int CB, int kFmaShare = DefaultFmaShare<K, CB>()>
__global__ void __launch_bounds__(256) DecodeCeilingKernel(const uint32_t* seeds, float* out, int iters,
                                                                 const Pow2Table pw) {
  const int lane = threadIdx.x & 31;
  constexpr int NW = LaneSlots<K>::kWords;
  const LaneSlots<K> slots(lane);
  uint32_t w[4][NW];
#pragma unroll
  for (int t = 0; t < 4; ++t)
#pragma unroll
    for (int i = 0; i < NW; ++i) w[t][i] = seeds[(threadIdx.x * 7 + t * 3 + i) & 1023];
  const uint32_t even[4] = {0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u};
  const uint32_t odd[4] = {0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u};
  const uint32_t mask = 0x8fff8fffu, flip = 0x3b603b60u;
  float acc[4][2][4] = {};
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      uint32_t b[8];
      DecodeLaneRaw<K, CB, kFmaShare>(w[t], slots.shift, mask, flip, pw, b);
      // As the GEMV: decoded elements are the A fragment of W^T, 8 tokens on the n side.
      const uint32_t ae[4] = {b[0], b[4], b[2], b[6]};
      const uint32_t ao[4] = {b[1], b[5], b[3], b[7]};
      Mma16816(acc[t][0], ae, even[0], even[1]);
      Mma16816(acc[t][0], ao, odd[0], odd[1]);
#pragma unroll
      for (int i = 0; i < NW; ++i) w[t][i] += 0x9E3779B9u;
    }
  }
  float s = 0.f;
#pragma unroll
  for (int t = 0; t < 4; ++t)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < 4; ++i) s += acc[t][h][i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

template <int K, int CB>
void LaunchDecodeCeiling(const uint32_t* seeds, float* out, int iters, int grid, int block,
                         cudaStream_t stream) {
  DecodeCeilingKernel<K, CB><<<grid, block, 0, stream>>>(seeds, out, iters, Pow2Table::Make());
}

}  // namespace exl3::cuda
