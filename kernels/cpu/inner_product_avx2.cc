// AVX2 + FMA + F16C decode-and-multiply. This file alone is compiled with -mavx2 -mfma -mf16c;
// nothing here runs unless Avx2Supported() said yes (no static initialisers use vector code).
//
// Per tile: the 16*K words are copied into a small buffer extended by one word on each side so
// the tail-biting windows never wrap; the 256 elements are decoded 8 at a time (one group = the 8
// elements of one fragment thread t, e = 8t..8t+7): gather the two 32-bit words under each
// element's 16-bit window with vpermd from one unaligned 8-word load, funnel-shift, then the
// codebook exactly as the AVX-512 loop does it (inner_product_avx512_impl.h explains it): the
// fp16 halves of 3INST/MCG by arithmetic shifts as fp32 times 2^-112, their exact sum times
// 2^112 (MUL1: h*scale+bias, exact), then the single fp16 rounding by Veltkamp's split.
// Bit-exact with the scalar decoder (every state of every codebook is checked by
// kernels_cpu_backend_test). Built without fp contraction: f - f * C must stay two roundings.
// Lane l of a group decodes element {0,1,4,5,2,3,6,7}[l]: tile rows
// {r0, r0+1, r0, r0+1, r0+8, r0+9, r0+8, r0+9} and columns {c0, c0, c0+8, c0+8, c0, c0, c0+8,
// c0+8}, r0 = 2(t%4), c0 = t/4. Avx2PrepareX lays x' out in that lane order, so the 4 groups of
// one c0 accumulate into one register, reduced to columns c0 and c0+8 at the end of the strip.
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/cpu/inner_product.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

namespace exl3::cpu {
namespace {

struct GroupIndex {
  alignas(32) int32_t hi[8];
  alignas(32) int32_t lo[8];
  alignas(32) int32_t sh[8];
  alignas(32) int32_t shr[8];
  int m0;
};

struct KIndex {
  GroupIndex g[32];
};

// Gather indices into the extended buffer (FillExtendedTile) per group of 8 elements.
const KIndex* IndexFor(int K) {
  static KIndex* tables = [] {
    auto* t = new KIndex[9];
    for (int k = 1; k <= 8; ++k) {
      for (int grp = 0; grp < 32; ++grp) {
        GroupIndex& g = t[k].g[grp];
        // Lane l decodes element kLaneElem[l] of the group, so that the lanes come out in the
        // order the accumulation wants (rows r0, r0+1 | r0+8, r0+9 per column pair).
        static const int kLaneElem[8] = {0, 1, 4, 5, 2, 3, 6, 7};
        int m0 = 0;
        for (int l = 0; l < 8; ++l) {
          const int e = 8 * grp + kLaneElem[l];
          const StateWindowPos pos = StateWindow(e, k);
          if (l == 0) m0 = pos.word;  // element 0 of the group has the lowest window
          g.m0 = m0;
          g.hi[l] = pos.word - m0;
          g.lo[l] = pos.word - m0 + 1;
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

template <int CB>
inline __m256 DecodeGroup(const uint32_t* ext, const GroupIndex& g) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ext + g.m0));
  const __m256i hi = _mm256_permutevar8x32_epi32(v, _mm256_load_si256(reinterpret_cast<const __m256i*>(g.hi)));
  const __m256i lo = _mm256_permutevar8x32_epi32(v, _mm256_load_si256(reinterpret_cast<const __m256i*>(g.lo)));
  const __m256i bits =
      _mm256_or_si256(_mm256_sllv_epi32(hi, _mm256_load_si256(reinterpret_cast<const __m256i*>(g.sh))),
                      _mm256_srlv_epi32(lo, _mm256_load_si256(reinterpret_cast<const __m256i*>(g.shr))));
  const __m256i s = _mm256_srli_epi32(bits, 16);
  __m256 f;
  if constexpr (CB == kCbMul1) {
    const __m256i x = _mm256_mullo_epi32(s, _mm256_set1_epi32(static_cast<int>(0x83DCD12Du)));
    const __m256i m8 = _mm256_set1_epi32(0x00ff00ff);
    const __m256i t = _mm256_add_epi32(_mm256_and_si256(x, m8),
                                       _mm256_and_si256(_mm256_srli_epi32(x, 8), m8));
    const __m256i sum = _mm256_add_epi32(_mm256_and_si256(t, _mm256_set1_epi32(0xffff)),
                                         _mm256_srli_epi32(t, 16));
    const __m256 h = _mm256_cvtepi32_ps(_mm256_add_epi32(sum, _mm256_set1_epi32(1024)));
    // fp16 0x1eee and 0xc931 as floats.
    f = _mm256_fmadd_ps(h, _mm256_set1_ps(0.00676727294921875f), _mm256_set1_ps(-10.3828125f));
  } else {
    __m256i x;
    if constexpr (CB == kCbMcg) {
      x = _mm256_mullo_epi32(s, _mm256_set1_epi32(static_cast<int>(0xCBAC1FEDu)));
    } else {
      x = _mm256_add_epi32(_mm256_mullo_epi32(s, _mm256_set1_epi32(89226354)),
                           _mm256_set1_epi32(64248484));
    }
    x = _mm256_xor_si256(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0x8fff8fffu))),
                         _mm256_set1_epi32(0x3b603b60));
    const __m256i m = _mm256_set1_epi32(static_cast<int>(0x8fffe000u));
    const __m256i lo = _mm256_and_si256(_mm256_srai_epi32(_mm256_slli_epi32(x, 16), 3), m);
    const __m256i hi = _mm256_and_si256(_mm256_srai_epi32(x, 3), m);
    f = _mm256_mul_ps(_mm256_add_ps(_mm256_castsi256_ps(lo), _mm256_castsi256_ps(hi)),
                      _mm256_set1_ps(0x1p112f));
  }
  const __m256 split = _mm256_mul_ps(f, _mm256_set1_ps(8193.0f));
  return _mm256_add_ps(split, _mm256_sub_ps(f, split));
}

// Lanes {0,1,4,5} belong to column c0, lanes {2,3,6,7} to column c0 + 8.
inline void ReduceStore(const __m256* acc, float* out16) {
  for (int c0 = 0; c0 < 8; ++c0) {
    alignas(32) float l[8];
    _mm256_store_ps(l, acc[c0]);
    out16[c0] = (l[0] + l[1]) + (l[4] + l[5]);
    out16[c0 + 8] = (l[2] + l[3]) + (l[6] + l[7]);
  }
}

// One strip of column tiles [j0, j1), all tile rows, T tokens. Tile rows are walked in memory
// order (row i of the strip is one contiguous run of (j1-j0) tiles), with the next rows
// prefetched; accumulators for the whole strip live in a small thread-local buffer (L1/L2).
template <int CB, int K>
void StripK(const Exl3LinearView& w, const float* xp, int T, int j0, int j1, float* y) {
  const int kt = w.in_features / 16, n = w.out_features, S = j1 - j0;
  const KIndex& idx = *IndexFor(K);
  constexpr int kWords = 8 * K;  // u32 words per tile
  // Two extended tile buffers: tile n+1 is copied while tile n is decoded, so the decoder's
  // unaligned loads never hit stores still in flight (store-to-load forwarding fails on such
  // partially overlapping loads and stalls for many cycles per group).
  alignas(32) uint32_t ext_buf[2][kWords + 2 + 8];
  auto fill = [&](uint32_t* e, int i, int s) { FillExtendedTile<K>(w, i, j0 + s, e); };
  fill(ext_buf[0], 0, 0);
  int cur = 0;
  const uint32_t* ext = ext_buf[0];
  auto decode = [&](int g) { return DecodeGroup<CB>(ext, idx.g[g]); };
  thread_local std::vector<float> acc_buf;
  const size_t acc_floats = static_cast<size_t>(T) * S * 64;
  if (acc_buf.size() < acc_floats) acc_buf.resize(acc_floats);
  float* acc = acc_buf.data();  // [T][S][8 c0][8 lanes]
  std::fill(acc, acc + acc_floats, 0.0f);
  constexpr int kLines = (kWords * 4 + 63) / 64;  // cache lines per tile
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
        const __m256 x0 = _mm256_loadu_ps(xi), x1 = _mm256_loadu_ps(xi + 8);
        const __m256 x2 = _mm256_loadu_ps(xi + 16), x3 = _mm256_loadu_ps(xi + 24);
        float* at = acc + static_cast<size_t>(s) * 64;
        for (int c0 = 0; c0 < 8; ++c0) {
          __m256 a = _mm256_loadu_ps(at + 8 * c0);
          a = _mm256_fmadd_ps(decode(4 * c0 + 0), x0, a);
          a = _mm256_fmadd_ps(decode(4 * c0 + 1), x1, a);
          a = _mm256_fmadd_ps(decode(4 * c0 + 2), x2, a);
          a = _mm256_fmadd_ps(decode(4 * c0 + 3), x3, a);
          _mm256_storeu_ps(at + 8 * c0, a);
        }
      } else {
        __m256 wv[32];
        for (int g = 0; g < 32; ++g) wv[g] = decode(g);
        for (int t = 0; t < T; ++t) {
          const float* xi = xp + (static_cast<size_t>(i) * T + t) * 32;
          const __m256 x0 = _mm256_loadu_ps(xi), x1 = _mm256_loadu_ps(xi + 8);
          const __m256 x2 = _mm256_loadu_ps(xi + 16), x3 = _mm256_loadu_ps(xi + 24);
          float* at = acc + (static_cast<size_t>(t) * S + s) * 64;
          for (int c0 = 0; c0 < 8; ++c0) {
            __m256 a = _mm256_loadu_ps(at + 8 * c0);
            a = _mm256_fmadd_ps(wv[4 * c0 + 0], x0, a);
            a = _mm256_fmadd_ps(wv[4 * c0 + 1], x1, a);
            a = _mm256_fmadd_ps(wv[4 * c0 + 2], x2, a);
            a = _mm256_fmadd_ps(wv[4 * c0 + 3], x3, a);
            _mm256_storeu_ps(at + 8 * c0, a);
          }
        }
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    for (int s = 0; s < S; ++s) {
      __m256 a8[8];
      const float* at = acc + (static_cast<size_t>(t) * S + s) * 64;
      for (int c0 = 0; c0 < 8; ++c0) a8[c0] = _mm256_loadu_ps(at + 8 * c0);
      ReduceStore(a8, y + static_cast<size_t>(t) * n + 16 * (j0 + s));
    }
  }
  ReleaseScratchIfLarge(acc_buf);
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

size_t Avx2PreparedFloats(int num_tokens, int k) { return static_cast<size_t>(num_tokens) * k * 2; }

void Avx2PrepareX(const float* xt, int num_tokens, int k, float* xp) {
  // Layout [k/16 tile rows][T tokens][4 groups][8 lanes]: one tile row's vectors for every token
  // are contiguous, so the multi-token loop streams through them. Group q of tile row i holds
  // x[16i + 2q + {0, 1, 0, 1, 8, 9, 8, 9}]: lanes 0-3 from the row's first 8 values, lanes 4-7
  // from its last 8, each picked by one permute.
  const __m256i idx[4] = {_mm256_setr_epi32(0, 1, 0, 1, 0, 1, 0, 1), _mm256_setr_epi32(2, 3, 2, 3, 2, 3, 2, 3),
                          _mm256_setr_epi32(4, 5, 4, 5, 4, 5, 4, 5), _mm256_setr_epi32(6, 7, 6, 7, 6, 7, 6, 7)};
  for (int t = 0; t < num_tokens; ++t) {
    const float* x = xt + static_cast<size_t>(t) * k;
    for (int i = 0; i < k / 16; ++i) {
      float* out = xp + (static_cast<size_t>(i) * num_tokens + t) * 32;
      const __m256 lo = _mm256_loadu_ps(x + 16 * i), hi = _mm256_loadu_ps(x + 16 * i + 8);
      for (int q = 0; q < 4; ++q) {
        _mm256_storeu_ps(out + 8 * q, _mm256_blend_ps(_mm256_permutevar8x32_ps(lo, idx[q]),
                                                      _mm256_permutevar8x32_ps(hi, idx[q]), 0xF0));
      }
    }
  }
}

void InnerProductAvx2(const Exl3LinearView& w, const float* xp, int num_tokens, int j0, int j1,
                      float* y) {
  switch (w.codebook) {
    case Codebook::k3Inst: Strip<kCb3Inst>(w, xp, num_tokens, j0, j1, y); break;
    case Codebook::kMcg: Strip<kCbMcg>(w, xp, num_tokens, j0, j1, y); break;
    case Codebook::kMul1: Strip<kCbMul1>(w, xp, num_tokens, j0, j1, y); break;
  }
}

}  // namespace exl3::cpu

#else  // not x86: the AVX2 path does not exist.

namespace exl3::cpu {
size_t Avx2PreparedFloats(int, int) { return 0; }
void Avx2PrepareX(const float*, int, int, float*) {}
void InnerProductAvx2(const Exl3LinearView&, const float*, int, int, int, float*) {}
}  // namespace exl3::cpu

#endif
