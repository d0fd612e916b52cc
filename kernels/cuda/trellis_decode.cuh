// In-register EXL3 trellis decoding on the GPU (device functions only).
//
// One warp decodes one 16x16 tile: lane t owns stream elements e = 8t..8t+7, which is exactly the
// B operand of two mma.m16n8k16 instructions (tile rows = k, columns 0-7 and 8-15 = n). Lane t's
// eight 16-bit states come from stream bits [8tK + K - 16, 8tK + 8K) (mod 256K): at most three
// packed 32-bit words, whose indices and bit offset depend only on (t, K). So each lane loads its
// words once per tile, aligns them with three funnel shifts, and extracts each state with a
// compile-time funnel shift; the codebook then runs in registers and hands back packed half2 pairs.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

namespace exl3::cuda {

enum : int { kCb3Inst = 0, kCbMcg = 1, kCbMul1 = 2 };

// Number of 32-bit words lane t needs (max over lanes) for bit width K.
__host__ __device__ constexpr int LaneWords(int K) {
  int most = 0;
  for (int t = 0; t < 32; ++t) {
    int start = 8 * t * K + K - 16;
    int o = ((start % 32) + 32) % 32;
    int n = (o + 7 * K + 16 + 31) / 32;
    if (n > most) most = n;
  }
  return most;
}

// Per-lane constants: word indices inside the tile (mod 8K) and the bit offset in the first word.
template <int K>
struct LaneSlots {
  static constexpr int kWords = LaneWords(K);
  int idx[kWords];
  int shift;
  __device__ __forceinline__ explicit LaneSlots(int lane) {
    int start = 8 * lane * K + K - 16;
    if (start < 0) start += 256 * K;
    const int w = start >> 5;
    shift = start & 31;
#pragma unroll
    for (int i = 0; i < kWords; ++i) {
      int j = w + i;
      if (j >= 8 * K) j -= 8 * K;
      idx[i] = j;
    }
  }
};

// Loads lane's words of the tile whose packed words start at `tile` (8K uint32 words).
template <int K>
__device__ __forceinline__ void LoadLaneWords(const uint32_t* __restrict__ tile, const LaneSlots<K>& s,
                                              uint32_t (&w)[LaneSlots<K>::kWords]) {
#pragma unroll
  for (int i = 0; i < LaneSlots<K>::kWords; ++i) w[i] = __ldg(tile + s.idx[i]);
}

// Decodes one pair of states into a packed half2 (low half = first state).
template <int CB>
__device__ __forceinline__ uint32_t DecodePair(uint32_t s0, uint32_t s1) {
  if constexpr (CB == kCbMul1) {
    const uint32_t x0 = s0 * 0x83DCD12Du, x1 = s1 * 0x83DCD12Du;
    const uint32_t u0 = __dp4a(x0, 0x01010101u, 0x6400u);  // fp16 bits of 1024 + byte sum
    const uint32_t u1 = __dp4a(x1, 0x01010101u, 0x6400u);
    const uint32_t h = __byte_perm(u0, u1, 0x5410);
    const __half2 scale = __halves2half2(__ushort_as_half(0x1eee), __ushort_as_half(0x1eee));
    const __half2 bias = __halves2half2(__ushort_as_half(0xc931), __ushort_as_half(0xc931));
    const __half2 r = __hfma2(*reinterpret_cast<const __half2*>(&h), scale, bias);
    return *reinterpret_cast<const uint32_t*>(&r);
  } else {
    uint32_t x0, x1;
    if constexpr (CB == kCbMcg) {
      x0 = s0 * 0xCBAC1FEDu;
      x1 = s1 * 0xCBAC1FEDu;
    } else {
      x0 = s0 * 89226354u + 64248484u;
      x1 = s1 * 89226354u + 64248484u;
    }
    x0 = (x0 & 0x8fff8fffu) ^ 0x3b603b60u;
    x1 = (x1 & 0x8fff8fffu) ^ 0x3b603b60u;
    const uint32_t lo = __byte_perm(x0, x1, 0x5410);
    const uint32_t hi = __byte_perm(x0, x1, 0x7632);
    const __half2 r = __hadd2(*reinterpret_cast<const __half2*>(&lo),
                              *reinterpret_cast<const __half2*>(&hi));
    return *reinterpret_cast<const uint32_t*>(&r);
  }
}

// Decodes lane's 8 elements of a tile from its loaded words into 4 packed half2 registers:
// b[0] = (e0, e1), b[1] = (e2, e3) (mma B fragment of columns 0-7), b[2] = (e4, e5), b[3] = (e6, e7)
// (columns 8-15).
template <int K, int CB>
__device__ __forceinline__ void DecodeLane(const uint32_t (&w)[LaneSlots<K>::kWords], int shift,
                                           uint32_t (&b)[4]) {
  constexpr int NW = LaneSlots<K>::kWords;
  // Align so that the lane's first needed bit is the MSB of v[0].
  uint32_t v[NW];
#pragma unroll
  for (int i = 0; i < NW; ++i) v[i] = (i + 1 < NW) ? __funnelshift_l(w[i + 1], w[i], shift) : (w[i] << shift);
  uint32_t s[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int p = j * K;  // state j occupies bits [p, p + 16) counted from v[0]'s MSB
    const int a = p >> 5, r = p & 31;
    if (r <= 16) {
      s[j] = (v[a] >> (16 - r)) & 0xffffu;
    } else {
      s[j] = __funnelshift_l(v[a + 1], v[a], r) >> 16;
    }
  }
#pragma unroll
  for (int q = 0; q < 4; ++q) b[q] = DecodePair<CB>(s[2 * q], s[2 * q + 1]);
}

// m16n8k16 fp16 mma with fp32 accumulate: d += a * b.
__device__ __forceinline__ void Mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace exl3::cuda
