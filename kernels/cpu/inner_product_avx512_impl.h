// The AVX-512 decode-and-multiply kernels, included by two files compiled with different flags:
// inner_product_avx512.cc (-mavx512f) instantiates them with kVbmi = false and
// inner_product_avx512vbmi.cc (-mavx512f -mavx512vbmi -mavx512bw) with kVbmi = true. Everything
// is in an anonymous namespace, so each file has its own copy compiled for its own instruction set.
//
// A tile's 256 elements are decoded 16 at a time (one "pair" of the AVX2 path's 8-element groups).
// Lane L of pair p decodes element 16p + kLaneElem[L], i.e. group 2p in lanes 0-7 and group 2p+1
// in lanes 8-15, each in the {0,1,4,5,2,3,6,7} order of the AVX2 path, so both paths share
// Avx2PrepareX's layout: the x' vectors of groups q and q+1 of one tile row are 16 consecutive
// floats. Products land in 16-lane accumulators [8 c0][16] (lanes {0,1,4,5} and their +8 -> column
// c0, lanes {2,3,6,7} and their +8 -> column c0 + 8), reduced in a fixed order at the end.
//
// Decoding one pair:
// 1. The 16-bit state of each lane (the trellis window, see StateWindow). AVX-512F: two vpermd
//    fetch the words above and below each window from one unaligned 16-word load, two variable
//    shifts and an or cut it out. VBMI: one vpermb gathers, per 64-bit lane, the 8 stream bytes
//    holding the windows of that lane's two elements, most significant first, and one
//    vpmultishiftqb cuts both windows out (zeroing the upper 16 bits of each 32-bit lane).
// 2. The codebook as fp32, exactly. 3INST/MCG: the two fp16 halves of the hashed word, both
//    normals with exponent fields 12..15; an arithmetic shift by 3 of a half at the top of the
//    word puts its sign at bit 31 (copies in 30..28, masked off) and its exponent and mantissa at
//    bits 27..13: an fp32 whose exponent field is the fp16's, i.e. the half's value times 2^-112,
//    a normal. The fp32 sum of the two is exact (11-bit significands, exponents within 3, no
//    result below 2^-125) and so is the product by 2^112. MUL1: h * scale + bias, exact in fp32.
// 3. One rounding to fp16 precision, which is how the codebooks define the value: Veltkamp's
//    split with C = 2^13 + 1 (c = f * C, f_11 = c + (f - c)) rounds f to 11 significant bits,
//    to nearest even on every value the codebooks produce (all are fp16 normals or zero; checked
//    over every state of every codebook by kernels_cpu_backend_test). Built without fp
//    contraction: f - f * C must stay two roundings.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>

#include "kernels/cpu/inner_product.h"

namespace exl3::cpu {
namespace {

enum { kCb3Inst = 0, kCbMcg = 1, kCbMul1 = 2 };

// Output lane L holds element kLaneElem[L] of the pair.
constexpr int kLaneElem[16] = {0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15};

// How to cut the 16 lanes' states of pair p out of the extended tile, for one K.
struct PairCut {
  int m0;  // first word of the 16-word load (the word of element 16p's window, the lowest)
  // AVX-512F: per lane, the loaded words above and below the window and the shifts.
  alignas(64) int32_t hi[16];
  alignas(64) int32_t lo[16];
  alignas(64) int32_t sh[16];
  alignas(64) int32_t shr[16];
  // VBMI: per byte of the result, the loaded byte it takes; per byte, the multishift bit offset.
  alignas(64) uint8_t bytes[64];
  alignas(64) uint8_t shifts[64];
};

struct KCuts {
  PairCut p[16];
};

const KCuts* CutsFor(int K) {
  static KCuts* tables = [] {
    auto* t = new KCuts[9];
    for (int k = 1; k <= 8; ++k) {
      for (int p = 0; p < 16; ++p) {
        PairCut& c = t[k].p[p];
        int start[16];  // window start, in bits of the extended tile (MSB first in each word)
        for (int l = 0; l < 16; ++l) {
          const StateWindowPos pos = StateWindow(16 * p + kLaneElem[l], k);
          if (l == 0) c.m0 = pos.word;
          c.hi[l] = pos.word - c.m0;
          c.lo[l] = pos.word - c.m0 + 1;
          c.sh[l] = pos.shift;
          c.shr[l] = 32 - pos.shift;
          start[l] = 32 * pos.word + pos.shift;
        }
        // 64-bit lane q holds lanes 2q (element a) and 2q + 1 (element a + 1, window K bits on).
        for (int q = 0; q < 8; ++q) {
          const int first_byte = start[2 * q] / 8;  // stream byte, extended-tile relative
          for (int j = 0; j < 8; ++j) {
            // Byte j of the lane = stream byte first_byte + 7 - j (the first one most significant);
            // stream byte m is byte 3 - m % 4 of word m / 4 in memory (little endian).
            const int m = first_byte + 7 - j - 4 * c.m0;
            c.bytes[8 * q + j] = static_cast<uint8_t>(4 * (m / 4) + 3 - m % 4);
          }
          // The lane's value V has stream bit first_byte * 8 + t at bit 63 - t: a window starting
          // d bits after first_byte * 8 is (V >> (48 - d)) & 0xffff.
          const int da = start[2 * q] - 8 * first_byte, db = start[2 * q + 1] - 8 * first_byte;
          const uint8_t sh[8] = {static_cast<uint8_t>(48 - da), static_cast<uint8_t>(56 - da), 0, 0,
                                 static_cast<uint8_t>(48 - db), static_cast<uint8_t>(56 - db), 0, 0};
          std::memcpy(c.shifts + 8 * q, sh, 8);
        }
      }
    }
    return t;
  }();
  return &tables[K];
}

inline __m512i LoadIdx(const void* p) { return _mm512_load_si512(p); }

// The 16 lanes' states (low 16 bits of each 32-bit lane, upper bits zero).
template <bool kVbmi>
inline __m512i States(const uint32_t* ext, const PairCut& c) {
  const __m512i v = _mm512_loadu_si512(ext + c.m0);
  if constexpr (kVbmi) {
    const __m512i b = _mm512_permutexvar_epi8(LoadIdx(c.bytes), v);
    return _mm512_maskz_multishift_epi64_epi8(0x3333333333333333ull, LoadIdx(c.shifts), b);
  } else {
    const __m512i hi = _mm512_permutexvar_epi32(LoadIdx(c.hi), v);
    const __m512i lo = _mm512_permutexvar_epi32(LoadIdx(c.lo), v);
    const __m512i bits = _mm512_or_si512(_mm512_sllv_epi32(hi, LoadIdx(c.sh)),
                                         _mm512_srlv_epi32(lo, LoadIdx(c.shr)));
    return _mm512_srli_epi32(bits, 16);
  }
}

template <int CB, bool kVbmi>
inline __m512 DecodePair(const uint32_t* ext, const PairCut& c) {
  const __m512i s = States<kVbmi>(ext, c);
  __m512 f;
  if constexpr (CB == kCbMul1) {
    const __m512i x = _mm512_mullo_epi32(s, _mm512_set1_epi32(static_cast<int>(0x83DCD12Du)));
    const __m512i m8 = _mm512_set1_epi32(0x00ff00ff);
    const __m512i t = _mm512_add_epi32(_mm512_and_si512(x, m8),
                                       _mm512_and_si512(_mm512_srli_epi32(x, 8), m8));
    const __m512i sum = _mm512_add_epi32(_mm512_and_si512(t, _mm512_set1_epi32(0xffff)),
                                         _mm512_srli_epi32(t, 16));
    const __m512 h = _mm512_cvtepi32_ps(_mm512_add_epi32(sum, _mm512_set1_epi32(1024)));
    f = _mm512_fmadd_ps(h, _mm512_set1_ps(0.00676727294921875f),  // fp16 0x1eee
                        _mm512_set1_ps(-10.3828125f));             // fp16 0xc931
  } else {
    __m512i x;
    if constexpr (CB == kCbMcg) {
      x = _mm512_mullo_epi32(s, _mm512_set1_epi32(static_cast<int>(0xCBAC1FEDu)));
    } else {
      x = _mm512_add_epi32(_mm512_mullo_epi32(s, _mm512_set1_epi32(89226354)),
                           _mm512_set1_epi32(64248484));
    }
    x = _mm512_xor_si512(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0x8fff8fffu))),
                         _mm512_set1_epi32(0x3b603b60));
    const __m512i m = _mm512_set1_epi32(static_cast<int>(0x8fffe000u));
    const __m512i lo = _mm512_and_si512(_mm512_srai_epi32(_mm512_slli_epi32(x, 16), 3), m);
    const __m512i hi = _mm512_and_si512(_mm512_srai_epi32(x, 3), m);
    f = _mm512_mul_ps(_mm512_add_ps(_mm512_castsi512_ps(lo), _mm512_castsi512_ps(hi)),
                      _mm512_set1_ps(0x1p112f));
  }
  const __m512 split = _mm512_mul_ps(f, _mm512_set1_ps(8193.0f));
  return _mm512_add_ps(split, _mm512_sub_ps(f, split));
}

// acc128: [8 c0][16 lanes]; lanes l and l + 8 hold the same (row pair, column). Per column, in
// this order: l_k = a_k + a_(k+8), then out[c0] = (l0 + l1) + (l4 + l5) and
// out[c0 + 8] = (l2 + l3) + (l6 + l7), done for two c0 per register (the same additions, lane
// by lane, as the scalar statement of it).
inline void ReduceStore(const float* acc128, float* out16) {
  __m512 r[4];
  for (int q = 0; q < 4; ++q) {  // c0 = 2q in lanes 0-7, c0 = 2q + 1 in lanes 8-15
    const __m512 a = _mm512_loadu_ps(acc128 + 32 * q), b = _mm512_loadu_ps(acc128 + 32 * q + 16);
    const __m512 l = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    // Lane 2i: l_2i + l_(2i+1).
    const __m512 m = _mm512_add_ps(l, _mm512_permute_ps(l, _MM_SHUFFLE(2, 3, 0, 1)));
    // Lane j: m_j + m_(j^4); lanes 0, 2 (8, 10) hold out[c0], out[c0 + 8] of the first (second) c0.
    r[q] = _mm512_add_ps(m, _mm512_shuffle_f32x4(m, m, _MM_SHUFFLE(2, 3, 0, 1)));
  }
  // out[0..3] and out[8..11] from r[0], r[1]; out[4..7] and out[12..15] from r[2], r[3].
  const __m512i pick = _mm512_setr_epi32(0, 8, 16, 24, 0, 0, 0, 0, 2, 10, 18, 26, 0, 0, 0, 0);
  const __m512 lo = _mm512_permutex2var_ps(r[0], pick, r[1]);
  const __m512 hi = _mm512_permutex2var_ps(r[2], pick, r[3]);
  const __m512i join = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
  _mm512_storeu_ps(out16, _mm512_permutex2var_ps(lo, join, hi));
}

// Decoded tiles a multi-token strip keeps at once (16 zmm = 1 KiB each): 16 KiB, half of L1.
constexpr int kWbufTiles = kAvx512BufferTiles;

// Tokens [t0, t0 + TB) x columns c0 in [4h, 4h + 4) of one column tile, over the tile rows of
// one chunk: the 4 TB accumulators stay in registers across the rows (weights read from the
// decoded chunk, x' from the prepared input), so each FMA costs half a load instead of a load and
// a store. Per accumulator lane the FMAs run in the same order as in the one-token loop (row by
// row, the pair 2 c0 with x0, then 2 c0 + 1 with x1), so the sums are the same to the bit.
// acc: [TB][8 c0][16 lanes], read first unless `first` (then zero), written at the end.
template <int TB>
__attribute__((always_inline)) inline void TokenBlock(const float* wtile, int rows, const float* xp, int T, int t0, int h,
                       bool first, float* acc) {
  __m512 a[TB][4];
  for (int t = 0; t < TB; ++t) {
    for (int c = 0; c < 4; ++c) {
      a[t][c] = first ? _mm512_setzero_ps()
                      : _mm512_loadu_ps(acc + static_cast<size_t>(t) * 128 + 16 * (4 * h + c));
    }
  }
  for (int r = 0; r < rows; ++r) {
    const float* wr = wtile + 256 * r + 128 * h;  // pairs 8h .. 8h + 7 of row r
    const float* xr = xp + (static_cast<size_t>(r) * T + t0) * 32;
    __m512 wv[8];
    for (int p = 0; p < 8; ++p) wv[p] = _mm512_load_ps(wr + 16 * p);
    for (int t = 0; t < TB; ++t) {
      const __m512 x0 = _mm512_loadu_ps(xr + 32 * t), x1 = _mm512_loadu_ps(xr + 32 * t + 16);
      for (int c = 0; c < 4; ++c) {
        a[t][c] = _mm512_fmadd_ps(wv[2 * c], x0, a[t][c]);
        a[t][c] = _mm512_fmadd_ps(wv[2 * c + 1], x1, a[t][c]);
      }
    }
  }
  for (int t = 0; t < TB; ++t) {
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + static_cast<size_t>(t) * 128 + 16 * (4 * h + c), a[t][c]);
  }
}

// Two tokens over the strip's column tiles, one column at a time: tile (i, j) for i = 0 .. k/16 - 1
// is decoded pair by pair straight into FMAs on [2][8 c0] register accumulators (no decoded-tile
// buffer, no accumulators in memory; measured faster than both other loops at T = 2, while one
// token is a little faster with the row-major loop). Per lane the FMAs run in the same order as in
// the other loops (row by row, pair 2 c0 with x0, then 2 c0 + 1 with x1).
template <int CB, int K, bool kVbmi>
__attribute__((noinline)) void TwoTokenStrip(const Exl3LinearView& w, const float* xp, int j0, int j1, float* y) {
  constexpr int TB = 2;
  const int kt = w.in_features / 16, n = w.out_features;
  const KCuts& idx = *CutsFor(K);
  constexpr int kWords = 8 * K;
  constexpr int kLines = (kWords * 4 + 63) / 64;  // cache lines per tile
  constexpr int kAhead = 4;                        // tiles prefetched ahead, down the column
  // Two extended tile buffers: tile n+1 is copied while tile n is decoded, so the decoder's
  // unaligned loads never hit stores still in flight (store-to-load forwarding fails on such
  // partially overlapping loads and stalls for many cycles per pair).
  alignas(64) uint32_t ext_buf[2][kWords + 2 + 16];
  int cur = 0;
  FillExtendedTile<K>(w, 0, j0, ext_buf[0]);
  for (int j = j0; j < j1; ++j) {
    __m512 acc[TB][8];
    for (int t = 0; t < TB; ++t) {
      for (int c0 = 0; c0 < 8; ++c0) acc[t][c0] = _mm512_setzero_ps();
    }
    for (int i = 0; i < kt; ++i) {
      const uint32_t* ext = ext_buf[cur];
      if (i + 1 < kt) {
        FillExtendedTile<K>(w, i + 1, j, ext_buf[cur ^ 1]);
      } else if (j + 1 < j1) {
        FillExtendedTile<K>(w, 0, j + 1, ext_buf[cur ^ 1]);
      }
      cur ^= 1;
      {
        const int ia = i + kAhead < kt ? i + kAhead : i + kAhead - kt;
        const int ja = i + kAhead < kt ? j : j + 1;
        if (ja < j1) {
          const char* next = reinterpret_cast<const char*>(w.tile(ia, ja));
          for (int l = 0; l < kLines; ++l) _mm_prefetch(next + 64 * l, _MM_HINT_T0);
        }
      }
      __m512 x0[TB], x1[TB];
      for (int t = 0; t < TB; ++t) {
        const float* xi = xp + (static_cast<size_t>(i) * TB + t) * 32;
        x0[t] = _mm512_loadu_ps(xi);
        x1[t] = _mm512_loadu_ps(xi + 16);
      }
      for (int c0 = 0; c0 < 8; ++c0) {
        const __m512 w0 = DecodePair<CB, kVbmi>(ext, idx.p[2 * c0]);
        const __m512 w1 = DecodePair<CB, kVbmi>(ext, idx.p[2 * c0 + 1]);
        for (int t = 0; t < TB; ++t) {
          acc[t][c0] = _mm512_fmadd_ps(w0, x0[t], acc[t][c0]);
          acc[t][c0] = _mm512_fmadd_ps(w1, x1[t], acc[t][c0]);
        }
      }
    }
    for (int t = 0; t < TB; ++t) {
      alignas(64) float red[128];
      for (int c0 = 0; c0 < 8; ++c0) _mm512_store_ps(red + 16 * c0, acc[t][c0]);
      ReduceStore(red, y + static_cast<size_t>(t) * n + 16 * j);
    }
  }
}

// Walks a strip's tiles in memory order (tile row by tile row, each row a contiguous run of the
// strip's S tiles), giving each tile's extended copy (FillExtendedTile) while the next one is
// copied into a second buffer: the decoder's unaligned loads never hit stores still in flight
// (store-to-load forwarding fails on such partially overlapping loads and stalls for many cycles).
template <int K>
struct RowMajorWalk {
  static constexpr int kWords = 8 * K;
  static constexpr int kLines = (kWords * 4 + 63) / 64;  // cache lines per tile
  const Exl3LinearView& w;
  int j0, S, kt;
  alignas(64) uint32_t ext_buf[2][kWords + 2 + 16];
  int cur = 0;

  RowMajorWalk(const Exl3LinearView& w_, int j0_, int j1_)
      : w(w_), j0(j0_), S(j1_ - j0_), kt(w_.in_features / 16) {
    FillExtendedTile<K>(w, 0, j0, ext_buf[0]);
  }
  // Tile (i, j0 + s), the next one in the walk; also prefetches row i + 2 at each row's start.
  const uint32_t* Next(int i, int s) {
    if (s == 0 && i + 2 < kt) {
      const char* next = reinterpret_cast<const char*>(w.tile(i + 2, j0));
      for (int l = 0; l < S * kLines; ++l) _mm_prefetch(next + 64 * l, _MM_HINT_T0);
    }
    const uint32_t* ext = ext_buf[cur];
    if (s + 1 < S) {
      FillExtendedTile<K>(w, i, j0 + s + 1, ext_buf[cur ^ 1]);
    } else if (i + 1 < kt) {
      FillExtendedTile<K>(w, i + 1, j0, ext_buf[cur ^ 1]);
    }
    cur ^= 1;
    return ext;
  }
};

// The three loops below are kept out of line: inlined together into one function they measured
// up to 8 % slower (register allocation of the decode shared between them).

// One token: decode and multiply at once, walking the strip row by row in memory order;
// accumulators [S][8 c0][16 lanes] in memory (L1).
template <int CB, int K, bool kVbmi>
__attribute__((noinline)) void OneTokenStrip(const Exl3LinearView& w, const float* xp, int j0,
                                             int j1, float* y) {
  const int kt = w.in_features / 16, S = j1 - j0;
  const KCuts& idx = *CutsFor(K);
  RowMajorWalk<K> walk(w, j0, j1);
  thread_local std::vector<float> acc_buf;
  const size_t acc_floats = static_cast<size_t>(S) * 128;
  if (acc_buf.size() < acc_floats) acc_buf.resize(acc_floats);
  float* acc = acc_buf.data();
  for (int i = 0; i < kt; ++i) {
    const float* xi = xp + static_cast<size_t>(i) * 32;
    const __m512 x0 = _mm512_loadu_ps(xi), x1 = _mm512_loadu_ps(xi + 16);
    for (int s = 0; s < S; ++s) {
      const uint32_t* ext = walk.Next(i, s);
      float* at = acc + static_cast<size_t>(s) * 128;
      for (int c0 = 0; c0 < 8; ++c0) {
        __m512 a = i == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(at + 16 * c0);
        a = _mm512_fmadd_ps(DecodePair<CB, kVbmi>(ext, idx.p[2 * c0]), x0, a);
        _mm512_storeu_ps(at + 16 * c0, _mm512_fmadd_ps(DecodePair<CB, kVbmi>(ext, idx.p[2 * c0 + 1]), x1, a));
      }
    }
  }
  for (int s = 0; s < S; ++s) ReduceStore(acc + static_cast<size_t>(s) * 128, y + 16 * (j0 + s));
}

// Several tokens: chunks of tile rows are decoded once into wbuf ([S][rows][16 pairs]), then
// multiplied by blocks of up to 4 tokens with register accumulators. Between chunks the
// accumulators wait in acc ([T][S][8 c0][16 lanes]); the last chunk reduces them into y.
template <int CB, int K, bool kVbmi>
__attribute__((noinline)) void MultiTokenStrip(const Exl3LinearView& w, const float* xp, int T,
                                               int j0, int j1, float* y) {
  const int kt = w.in_features / 16, n = w.out_features, S = j1 - j0;
  const KCuts& idx = *CutsFor(K);
  RowMajorWalk<K> walk(w, j0, j1);
  const int rows_per_chunk = std::clamp(kWbufTiles / S, 1, kt);
  thread_local std::vector<float> wbuf_store;
  thread_local std::vector<float> acc_buf;
  const size_t wbuf_floats = static_cast<size_t>(S) * rows_per_chunk * 256;
  if (wbuf_store.size() < wbuf_floats + 16) wbuf_store.resize(wbuf_floats + 16);
  const bool one_chunk = rows_per_chunk >= kt;
  if (!one_chunk && acc_buf.size() < static_cast<size_t>(T) * S * 128) {
    acc_buf.resize(static_cast<size_t>(T) * S * 128);
  }
  float* wbuf = wbuf_store.data();  // 64-byte aligned within the store
  wbuf += (16 - (reinterpret_cast<uintptr_t>(wbuf) / sizeof(float)) % 16) % 16;
  alignas(64) float red[4 * 128];  // one token block's accumulators ([4][8 c0][16 lanes])
  for (int i0 = 0; i0 < kt; i0 += rows_per_chunk) {
    const int rows = std::min(rows_per_chunk, kt - i0);
    for (int r = 0; r < rows; ++r) {
      const int i = i0 + r;
      for (int s = 0; s < S; ++s) {
        const uint32_t* ext = walk.Next(i, s);
        float* wt = wbuf + (static_cast<size_t>(s) * rows_per_chunk + r) * 256;
        for (int p = 0; p < 16; ++p) _mm512_store_ps(wt + 16 * p, DecodePair<CB, kVbmi>(ext, idx.p[p]));
      }
    }
    const bool first = i0 == 0, last = i0 + rows >= kt;
    const float* xc = xp + static_cast<size_t>(i0) * T * 32;
    for (int s = 0; s < S; ++s) {
      const float* wt = wbuf + static_cast<size_t>(s) * rows_per_chunk * 256;
      for (int t0 = 0; t0 < T; t0 += 4) {
        const int tb = std::min(4, T - t0);
        // Between chunks a block's accumulators go through red (token stride 128) to and from
        // acc (token stride S * 128).
        for (int h = 0; h < 2; ++h) {
          float* acc_io = one_chunk ? nullptr : acc_buf.data() + (static_cast<size_t>(t0) * S + s) * 128;
          if (!first) {
            for (int t = 0; t < tb; ++t) {
              std::memcpy(red + t * 128 + 64 * h, acc_io + static_cast<size_t>(t) * S * 128 + 64 * h, 64 * sizeof(float));
            }
          }
          switch (tb) {
            case 1: TokenBlock<1>(wt, rows, xc, T, t0, h, first, red); break;
            case 2: TokenBlock<2>(wt, rows, xc, T, t0, h, first, red); break;
            case 3: TokenBlock<3>(wt, rows, xc, T, t0, h, first, red); break;
            default: TokenBlock<4>(wt, rows, xc, T, t0, h, first, red); break;
          }
          if (!last) {
            for (int t = 0; t < tb; ++t) {
              std::memcpy(acc_io + static_cast<size_t>(t) * S * 128 + 64 * h, red + t * 128 + 64 * h, 64 * sizeof(float));
            }
          }
        }
        if (last) {
          for (int t = 0; t < tb; ++t) ReduceStore(red + t * 128, y + static_cast<size_t>(t0 + t) * n + 16 * (j0 + s));
        }
      }
    }
  }
  ReleaseScratchIfLarge(acc_buf);
}


template <int CB, int K, bool kVbmi>
void StripK(const Exl3LinearView& w, const float* xp, int T, int j0, int j1, float* y) {
  if (T == 1) {
    OneTokenStrip<CB, K, kVbmi>(w, xp, j0, j1, y);
  } else if (T == 2) {
    TwoTokenStrip<CB, K, kVbmi>(w, xp, j0, j1, y);
  } else {
    MultiTokenStrip<CB, K, kVbmi>(w, xp, T, j0, j1, y);
  }
}

template <int CB, bool kVbmi>
void Strip(const Exl3LinearView& w, const float* xp, int T, int j0, int j1, float* y) {
  switch (w.bits) {
    case 1: StripK<CB, 1, kVbmi>(w, xp, T, j0, j1, y); break;
    case 2: StripK<CB, 2, kVbmi>(w, xp, T, j0, j1, y); break;
    case 3: StripK<CB, 3, kVbmi>(w, xp, T, j0, j1, y); break;
    case 4: StripK<CB, 4, kVbmi>(w, xp, T, j0, j1, y); break;
    case 5: StripK<CB, 5, kVbmi>(w, xp, T, j0, j1, y); break;
    case 6: StripK<CB, 6, kVbmi>(w, xp, T, j0, j1, y); break;
    case 7: StripK<CB, 7, kVbmi>(w, xp, T, j0, j1, y); break;
    case 8: StripK<CB, 8, kVbmi>(w, xp, T, j0, j1, y); break;
  }
}

template <bool kVbmi>
void InnerProductAvx512Impl(const Exl3LinearView& w, const float* xp, int num_tokens, int j0,
                            int j1, float* y) {
  switch (w.codebook) {
    case Codebook::k3Inst: Strip<kCb3Inst, kVbmi>(w, xp, num_tokens, j0, j1, y); break;
    case Codebook::kMcg: Strip<kCbMcg, kVbmi>(w, xp, num_tokens, j0, j1, y); break;
    case Codebook::kMul1: Strip<kCbMul1, kVbmi>(w, xp, num_tokens, j0, j1, y); break;
  }
}

}  // namespace
}  // namespace exl3::cpu
