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

// (x & m) ^ c in one LOP3 (the constants in registers: written as two immediates, ptxas emits
// two LOP3s).
__device__ __forceinline__ uint32_t AndXor(uint32_t x, uint32_t m, uint32_t c) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0x6A;\n" : "=r"(r) : "r"(x), "r"(m), "r"(c));
  return r;
}

// Powers of two 2^0..2^16 passed as kernel parameters: multiplying by them is a shift that ptxas
// cannot turn back into SHF, so part of the state extraction runs on the IMAD (FMA) pipe instead
// of the ALU pipe, which the codebook's LOP3s and the other shifts keep busy.
struct Pow2Table {
  uint32_t p[17];
  __host__ __device__ static Pow2Table Make() {
    Pow2Table t{};
    for (int i = 0; i <= 16; ++i) t.p[i] = 1u << i;
    return t;
  }
};

// Where DecodeLaneRaw takes each of a lane's 8 states from. A state is one instruction away from a
// 32-bit window of the aligned bits whose MSB is `offset` = 0, 8 or 16 bits before the state's:
//   0: window >> 16 (SHF, or IMAD.HI by 2^16 on the FMA pipe), 8: one PRMT (bytes 1-2, zero-filled),
//   16: window & 0xffff.
// At K = 2, 4 and 8 states 8, 16 bits apart share a window (state j starts jK bits in): K = 2
// needs 4 windows for 8 states, K = 4 four, K = 8 three, and each window costs at most one funnel
// shift, so a state costs ~1.5 instructions instead of 2. At other K no two states are a multiple
// of 8 bits apart within 16 (jK mod 8 differs), so the plan would cost the same two per state as
// the direct extraction, which is kept there (kUseWindows).
template <int K>
struct StatePlan {
  int windows = 0;
  int base[8] = {};    // window w starts base[w] bits after the lane's first bit
  int window[8] = {};  // state j's window
  int offset[8] = {};  // state j's offset in it
  constexpr StatePlan() {
    for (int j = 0; j < 8; ++j) {
      const int p = j * K;
      int w = 0;
      while (w < windows && !(p - base[w] == 0 || p - base[w] == 8 || p - base[w] == 16)) ++w;
      if (w == windows) base[windows++] = p;
      window[j] = w;
      offset[j] = p - base[w];
    }
  }
  static constexpr bool kUseWindows = K == 2 || K == 4 || K == 8;
};

// The lane's 8 states of a tile as raw mma operands, without the final fp16 combine:
//   3INST/MCG: b[j] = the masked word, a half2 (lo, hi) whose sum is element j's weight;
//   MUL1:      b[j] = (1024 + byte sum, +0) as half2; the weight is scale * that + bias.
// The sums are folded into the mma instead (MmaTileRaw): each A value is duplicated into both
// halves of its register, so the tensor core adds lo + hi (in fp32, no fp16 rounding of the
// weight). That removes the PRMT + HADD2 / HFMA2 per pair from the ALU/FMA pipes.
// Powers of two 2^0..2^16 passed as kernel parameters: multiplying by them is a shift that ptxas
// cannot turn back into SHF, so part of the state extraction runs on the IMAD (FMA) pipe instead
// of the ALU pipe, which the codebook's LOP3s and the other shifts keep busy.
// With windows, up to 7 instructions per tile may run on either pipe: the windows cut from v[a]
// alone (a shift, or a multiply by a power of two) and the offset-0 states (a shift, or IMAD.HI
// by 2^16); kFmaShare of them, windows first, go to the FMA pipe (ptxas rebalances some itself).
// The shares are the best of a sweep of 0..7 on an H200 (decode ceiling, bench/results/h200.md,
// session 10): K = 2: 3 for MCG / 3INST (5.20 / 5.12 T weights/s; 4.38 / 4.18 at 7), 2 for MUL1,
// whose IMAD + IDP per state already load the FMA pipe (4.94; 3.71 at 7); K = 4 and 8: 0 (4.85
// MCG, 5.25 MUL1 at K = 4; 4.34 / 4.00 at 7).
// Without windows (the other K), a state whose 16 bits lie in one aligned word costs a shift and
// a mask (ALU) or a multiply by 2^r and IMAD.HI by 2^16 (FMA); kFmaShare of those states take the
// FMA form, even j first (DirectFmaRank). The same sweep found 0 best at K = 1, 3, 5, 6, 7 for
// MCG and MUL1 (K = 3 MCG 4.14 T weights/s, 3.95 with the even states on the FMA pipe as before).
__host__ __device__ constexpr int DirectFmaRank(int K, int j) {
  if ((j * K & 31) > 16) return 8;  // a funnel shift and a shift: ALU only
  int rank = 0;
  for (int i = 0; i < 8; ++i) {
    const bool before = (i & 1) < (j & 1) || ((i & 1) == (j & 1) && i < j);
    if ((i * K & 31) <= 16 && before) ++rank;
  }
  return rank;
}
template <int K, int CB>
__host__ __device__ constexpr int DefaultFmaShare() {
  return K == 2 ? (CB == kCbMul1 ? 2 : 3) : 0;
}

template <int K, int CB, int kFmaShare = DefaultFmaShare<K, CB>()>
__device__ __forceinline__ void DecodeLaneRaw(const uint32_t (&w)[LaneSlots<K>::kWords], int shift,
                                              uint32_t mask, uint32_t flip, const Pow2Table& pw,
                                              uint32_t (&b)[8]) {
  constexpr int NW = LaneSlots<K>::kWords;
  uint32_t v[NW];
#pragma unroll
  for (int i = 0; i < NW; ++i) v[i] = (i + 1 < NW) ? __funnelshift_l(w[i + 1], w[i], shift) : (w[i] << shift);
  uint32_t st[8];
  if constexpr (StatePlan<K>::kUseWindows) {
    constexpr StatePlan<K> plan;
    int fma_left = kFmaShare;  // folded at compile time: every loop below is unrolled
    uint32_t win[8];
#pragma unroll
    for (int i = 0; i < plan.windows; ++i) {
      const int a = plan.base[i] >> 5, r = plan.base[i] & 31;
      // The last bit any state of the window needs: within v[a] alone, a shift does; else a
      // funnel shift from v[a + 1].
      int need = 0;
      for (int j = 0; j < 8; ++j)
        if (plan.window[j] == i && plan.offset[j] + 16 > need) need = plan.offset[j] + 16;
      if (r == 0) {
        win[i] = v[a];
      } else if (r + need <= 32) {
        win[i] = fma_left > 0 ? v[a] * pw.p[r] : v[a] << r;
        --fma_left;
      } else {
        win[i] = __funnelshift_l(v[a + 1], v[a], r);
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint32_t x = win[plan.window[j]];
      if (plan.offset[j] == 0) {
        st[j] = fma_left > 0 ? __umulhi(x, pw.p[16]) : x >> 16;
        --fma_left;
      } else if (plan.offset[j] == 8) {
        st[j] = __byte_perm(x, 0u, 0x4421);
      } else {
        st[j] = x & 0xffffu;
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int p = j * K;
      const int a = p >> 5, r = p & 31;
      if (DirectFmaRank(K, j) < kFmaShare) {
        st[j] = __umulhi(v[a] * pw.p[r], pw.p[16]);  // (v << r) >> 16 on the IMAD pipe
      } else if (r <= 16) {
        st[j] = (v[a] >> (16 - r)) & 0xffffu;
      } else {
        st[j] = __funnelshift_l(v[a + 1], v[a], r) >> 16;
      }
    }
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if constexpr (CB == kCbMul1) {
      b[j] = __dp4a(st[j] * 0x83DCD12Du, 0x01010101u, 0x6400u);
    } else if constexpr (CB == kCbMcg) {
      b[j] = AndXor(st[j] * 0xCBAC1FEDu, mask, flip);
    } else {
      b[j] = AndXor(st[j] * 89226354u + 64248484u, mask, flip);
    }
  }
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

namespace exl3::cuda {

// A fragment with each k-column's value duplicated into both halves: even = columns 2c / 2c+8,
// odd = columns 2c+1 / 2c+9 (see DecodeLaneRaw).
__device__ __forceinline__ void SplitA(const uint32_t (&a)[4], uint32_t (&even)[4], uint32_t (&odd)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    even[i] = __byte_perm(a[i], a[i], 0x1010);
    odd[i] = __byte_perm(a[i], a[i], 0x3232);
  }
}

// acc[h] (columns 8h..8h+7 of the tile) += A · tile, from raw operands: 4 mma per tile.
__device__ __forceinline__ void MmaTileRaw(float (&acc)[2][4], const uint32_t (&even)[4], const uint32_t (&odd)[4],
                                           const uint32_t (&b)[8]) {
  Mma16816(acc[0], even, b[0], b[2]);
  Mma16816(acc[0], odd, b[1], b[3]);
  Mma16816(acc[1], even, b[4], b[6]);
  Mma16816(acc[1], odd, b[5], b[7]);
}

}  // namespace exl3::cuda
