// AVX-512F kernels of kernels/hadamard.h. This file alone is compiled with -mavx512f (and
// -ffp-contract=off: a multiply followed by an add must stay two roundings, as in the scalar
// kernel); nothing here runs unless HadamardIsaSupported(kAvx512) said yes.
//
// The 128 values sit in 8 registers of 16. Butterfly stages h = 1, 2, 4, 8 pair lanes of one
// register (the partner comes from a permute), h = 16, 32, 64 pair whole registers. Each value
// gets exactly the scalar kernel's operation: a + b where it is the lower element of its pair,
// a - b (the partner minus itself) where it is the upper one.
#include "kernels/hadamard.h"

#include "kernels/fp16.h"

#if defined(__x86_64__)
#include <immintrin.h>

namespace exl3 {
namespace {

// Lanes in `upper` are the upper elements of their pairs.
inline __m512 Butterfly(__m512 v, __m512 partner, __mmask16 upper) {
  return _mm512_mask_sub_ps(_mm512_add_ps(v, partner), upper, partner, v);
}

inline void Butterflies(__m512 (&v)[8]) {
  for (int r = 0; r < 8; ++r) {
    v[r] = Butterfly(v[r], _mm512_permute_ps(v[r], _MM_SHUFFLE(2, 3, 0, 1)), 0xAAAA);  // h = 1
  }
  for (int r = 0; r < 8; ++r) {
    v[r] = Butterfly(v[r], _mm512_permute_ps(v[r], _MM_SHUFFLE(1, 0, 3, 2)), 0xCCCC);  // h = 2
  }
  for (int r = 0; r < 8; ++r) {  // h = 4: swap the 128-bit quarters of each half
    v[r] = Butterfly(v[r], _mm512_shuffle_f32x4(v[r], v[r], _MM_SHUFFLE(2, 3, 0, 1)), 0xF0F0);
  }
  for (int r = 0; r < 8; ++r) {  // h = 8: swap the 256-bit halves
    v[r] = Butterfly(v[r], _mm512_shuffle_f32x4(v[r], v[r], _MM_SHUFFLE(1, 0, 3, 2)), 0xFF00);
  }
  for (int d = 1; d < 8; d <<= 1) {  // h = 16 d: registers r and r + d
    for (int r = 0; r < 8; ++r) {
      if (r & d) continue;
      const __m512 a = v[r], b = v[r + d];
      v[r] = _mm512_add_ps(a, b);
      v[r + d] = _mm512_sub_ps(a, b);
    }
  }
  const __m512 s = _mm512_set1_ps(kHadamard128Scale);
  for (int r = 0; r < 8; ++r) v[r] = _mm512_mul_ps(v[r], s);
}

void Hadamard128Avx512(float* p) {
  __m512 v[8];
  for (int r = 0; r < 8; ++r) v[r] = _mm512_loadu_ps(p + 16 * r);
  Butterflies(v);
  for (int r = 0; r < 8; ++r) _mm512_storeu_ps(p + 16 * r, v[r]);
}

void ScaleHadamard128Avx512(const float* x, const float* scale, float* out) {
  __m512 v[8];
  for (int r = 0; r < 8; ++r) {
    v[r] = _mm512_mul_ps(_mm512_loadu_ps(x + 16 * r), _mm512_loadu_ps(scale + 16 * r));
  }
  Butterflies(v);
  for (int r = 0; r < 8; ++r) _mm512_storeu_ps(out + 16 * r, v[r]);
}

void Hadamard128ScaleBiasAvx512(float* p, const float* scale, const float* bias) {
  __m512 v[8];
  for (int r = 0; r < 8; ++r) v[r] = _mm512_loadu_ps(p + 16 * r);
  Butterflies(v);
  for (int r = 0; r < 8; ++r) v[r] = _mm512_mul_ps(v[r], _mm512_loadu_ps(scale + 16 * r));
  if (bias != nullptr) {
    for (int r = 0; r < 8; ++r) v[r] = _mm512_add_ps(v[r], _mm512_loadu_ps(bias + 16 * r));
  }
  for (int r = 0; r < 8; ++r) _mm512_storeu_ps(p + 16 * r, v[r]);
}

void HalfToFloatAvx512(const uint16_t* h, float* out, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i))));
  }
  for (; i < n; ++i) out[i] = HalfBitsToFloat(h[i]);
}

}  // namespace

const HadamardKernels& HadamardKernelsAvx512() {
  static const HadamardKernels k = {Hadamard128Avx512, ScaleHadamard128Avx512,
                                    Hadamard128ScaleBiasAvx512, HalfToFloatAvx512};
  return k;
}

}  // namespace exl3

#else  // not x86-64: never selected (HadamardIsaSupported says no).

namespace exl3 {
const HadamardKernels& HadamardKernelsAvx512() { return HadamardKernelsFor(HadamardIsa::kScalar); }
}  // namespace exl3

#endif
