// AVX-512F decode-and-multiply: the AVX2 loop (inner_product_avx2.cc, whose comment explains the
// bit cutting and the codebooks) widened to 16 lanes, i.e. two 8-element groups at a time. This
// file alone is compiled with -mavx512f; nothing here runs unless Avx512Supported() said yes.
//
// Lanes 0-7 hold group 2p, lanes 8-15 group 2p+1, each in the {0,1,4,5,2,3,6,7} element order of
// the AVX2 path, so both paths share Avx2PrepareX's layout: the x' vectors of groups q and q+1 of
// one tile row are 16 consecutive floats. Products are folded back into the 8-lane accumulators
// the AVX2 path uses (lanes {0,1,4,5} -> column c0, {2,3,6,7} -> column c0 + 8).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/cpu/inner_product.h"

#if defined(__x86_64__)
#include <immintrin.h>

namespace exl3::cpu {
namespace {

struct PairIndex {
  alignas(64) int32_t hi[16];
  alignas(64) int32_t lo[16];
  alignas(64) int32_t sh[16];
  alignas(64) int32_t shr[16];
  int m0;
};

struct KPairs {
  PairIndex p[16];
};

// Lane L of pair p decodes element 16p + L (natural order); the codebook step reorders.
const KPairs* PairsFor(int K) {
  static KPairs* tables = [] {
    auto* t = new KPairs[9];
    for (int k = 1; k <= 8; ++k) {
      for (int p = 0; p < 16; ++p) {
        PairIndex& g = t[k].p[p];
        for (int l = 0; l < 16; ++l) {
          const int e = 16 * p + l;
          const StateWindowPos pos = StateWindow(e, k);
          if (l == 0) g.m0 = pos.word;
          g.hi[l] = pos.word - g.m0;
          g.lo[l] = pos.word - g.m0 + 1;
          g.sh[l] = pos.shift;
          g.shr[l] = 32 - pos.shift;
        }
      }
    }
    return t;
  }();
  return &tables[K];
}

enum { kCb3Inst = 0, kCbMcg = 1, kCbMul1 = 2 };

// Output lane L holds element kLaneElem[L] of the pair.
constexpr int kLaneElem[16] = {0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15};

inline __m512i LoadIdx(const int32_t* p) { return _mm512_load_si512(p); }

template <int CB>
inline __m512 DecodePair(const uint32_t* ext, const PairIndex& g) {
  const __m512i v = _mm512_loadu_si512(ext + g.m0);
  const __m512i hi = _mm512_permutexvar_epi32(LoadIdx(g.hi), v);
  const __m512i lo = _mm512_permutexvar_epi32(LoadIdx(g.lo), v);
  const __m512i bits = _mm512_or_si512(_mm512_sllv_epi32(hi, LoadIdx(g.sh)),
                                       _mm512_srlv_epi32(lo, LoadIdx(g.shr)));
  const __m512i s = _mm512_srli_epi32(bits, 16);
  __m512 f;
  if constexpr (CB == kCbMul1) {
    const __m512i x = _mm512_mullo_epi32(s, _mm512_set1_epi32(static_cast<int>(0x83DCD12Du)));
    const __m512i m8 = _mm512_set1_epi32(0x00ff00ff);
    const __m512i t = _mm512_add_epi32(_mm512_and_si512(x, m8),
                                       _mm512_and_si512(_mm512_srli_epi32(x, 8), m8));
    const __m512i sum = _mm512_add_epi32(_mm512_and_si512(t, _mm512_set1_epi32(0xffff)),
                                         _mm512_srli_epi32(t, 16));
    const __m512 h = _mm512_cvtepi32_ps(_mm512_add_epi32(sum, _mm512_set1_epi32(1024)));
    const __m512 r = _mm512_fmadd_ps(h, _mm512_set1_ps(0.00676727294921875f),  // fp16 0x1eee
                                     _mm512_set1_ps(-10.3828125f));             // fp16 0xc931
    f = _mm512_permutexvar_ps(_mm512_loadu_si512(kLaneElem), r);
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
    // a = [l0 h0 l1 h1 ... l7 h7], b = the same for elements 8..15.
    const __m512 a = _mm512_cvtph_ps(_mm512_castsi512_si256(x));
    const __m512 b = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(x, 1));
    alignas(64) static constexpr int32_t kLo[16] = {0, 2, 8, 10, 4, 6, 12, 14,
                                                    16, 18, 24, 26, 20, 22, 28, 30};
    alignas(64) static constexpr int32_t kHi[16] = {1, 3, 9, 11, 5, 7, 13, 15,
                                                    17, 19, 25, 27, 21, 23, 29, 31};
    f = _mm512_add_ps(_mm512_permutex2var_ps(a, LoadIdx(kLo), b),
                      _mm512_permutex2var_ps(a, LoadIdx(kHi), b));
  }
  return _mm512_cvtph_ps(_mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// acc128: [8 c0][16 lanes]; lanes l and l + 8 hold the same (row pair, column).
inline void ReduceStore(const float* acc128, float* out16) {
  for (int c0 = 0; c0 < 8; ++c0) {
    const float* a = acc128 + 16 * c0;
    float l[8];
    for (int k = 0; k < 8; ++k) l[k] = a[k] + a[k + 8];
    out16[c0] = (l[0] + l[1]) + (l[4] + l[5]);
    out16[c0 + 8] = (l[2] + l[3]) + (l[6] + l[7]);
  }
}

template <int CB, int K>
void StripK(const Exl3LinearView& w, const float* xp, int T, int j0, int j1, float* y) {
  const int kt = w.in_features / 16, n = w.out_features, S = j1 - j0;
  const KPairs& idx = *PairsFor(K);
  constexpr int kWords = 8 * K;
  // Two extended tile buffers: tile n+1 is copied while tile n is decoded, so the decoder's
  // unaligned loads never hit stores still in flight (store-to-load forwarding fails on such
  // partially overlapping loads and stalls for many cycles per group).
  alignas(64) uint32_t ext_buf[2][kWords + 2 + 16];
  auto fill = [&](uint32_t* e, int i, int s) { FillExtendedTile<K>(w, i, j0 + s, e); };
  fill(ext_buf[0], 0, 0);
  int cur = 0;
  const uint32_t* ext = ext_buf[0];
  thread_local std::vector<float> acc_buf;
  const size_t acc_floats = static_cast<size_t>(T) * S * 128;
  if (acc_buf.size() < acc_floats) acc_buf.resize(acc_floats);
  float* acc = acc_buf.data();  // [T][S][8 c0][16 lanes]
  std::fill(acc, acc + acc_floats, 0.0f);
  constexpr int kLines = (kWords * 4 + 63) / 64;
  for (int i = 0; i < kt; ++i) {
    if (i + 2 < kt) {
      const char* next = reinterpret_cast<const char*>(w.tile(i + 2, j0));
      for (int l = 0; l < S * kLines; ++l) _mm_prefetch(next + 64 * l, _MM_HINT_T0);
    }
    for (int s = 0; s < S; ++s) {
      ext = ext_buf[cur];
      if (s + 1 < S) {
        fill(ext_buf[cur ^ 1], i, s + 1);
      } else if (i + 1 < kt) {
        fill(ext_buf[cur ^ 1], i + 1, 0);
      }
      cur ^= 1;
      if (T == 1) {
        const float* xi = xp + static_cast<size_t>(i) * 32;
        const __m512 x0 = _mm512_loadu_ps(xi), x1 = _mm512_loadu_ps(xi + 16);
        float* at = acc + static_cast<size_t>(s) * 128;
        for (int c0 = 0; c0 < 8; ++c0) {
          __m512 a = _mm512_loadu_ps(at + 16 * c0);
          a = _mm512_fmadd_ps(DecodePair<CB>(ext, idx.p[2 * c0]), x0, a);
          _mm512_storeu_ps(at + 16 * c0, _mm512_fmadd_ps(DecodePair<CB>(ext, idx.p[2 * c0 + 1]), x1, a));
        }
      } else {
        __m512 wv[16];
        for (int p = 0; p < 16; ++p) wv[p] = DecodePair<CB>(ext, idx.p[p]);
        for (int t = 0; t < T; ++t) {
          const float* xi = xp + (static_cast<size_t>(i) * T + t) * 32;
          const __m512 x0 = _mm512_loadu_ps(xi), x1 = _mm512_loadu_ps(xi + 16);
          float* at = acc + (static_cast<size_t>(t) * S + s) * 128;
          for (int c0 = 0; c0 < 8; ++c0) {
            __m512 a = _mm512_loadu_ps(at + 16 * c0);
            a = _mm512_fmadd_ps(wv[2 * c0], x0, a);
            _mm512_storeu_ps(at + 16 * c0, _mm512_fmadd_ps(wv[2 * c0 + 1], x1, a));
          }
        }
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    for (int s = 0; s < S; ++s) {
      ReduceStore(acc + (static_cast<size_t>(t) * S + s) * 128, y + static_cast<size_t>(t) * n + 16 * (j0 + s));
    }
  }
}

template <int CB>
void Strip(const Exl3LinearView& w, const float* xp, int T, int j0, int j1, float* y) {
  switch (w.bits) {
    case 1: StripK<CB, 1>(w, xp, T, j0, j1, y); break;
    case 2: StripK<CB, 2>(w, xp, T, j0, j1, y); break;
    case 3: StripK<CB, 3>(w, xp, T, j0, j1, y); break;
    case 4: StripK<CB, 4>(w, xp, T, j0, j1, y); break;
    case 5: StripK<CB, 5>(w, xp, T, j0, j1, y); break;
    case 6: StripK<CB, 6>(w, xp, T, j0, j1, y); break;
    case 7: StripK<CB, 7>(w, xp, T, j0, j1, y); break;
    case 8: StripK<CB, 8>(w, xp, T, j0, j1, y); break;
  }
}

}  // namespace

void InnerProductAvx512(const Exl3LinearView& w, const float* xp, int num_tokens, int j0, int j1,
                        float* y) {
  switch (w.codebook) {
    case Codebook::k3Inst: Strip<kCb3Inst>(w, xp, num_tokens, j0, j1, y); break;
    case Codebook::kMcg: Strip<kCbMcg>(w, xp, num_tokens, j0, j1, y); break;
    case Codebook::kMul1: Strip<kCbMul1>(w, xp, num_tokens, j0, j1, y); break;
  }
}

}  // namespace exl3::cpu

#else  // not x86-64

namespace exl3::cpu {
void InnerProductAvx512(const Exl3LinearView&, const float*, int, int, int, float*) {}
}  // namespace exl3::cpu

#endif
