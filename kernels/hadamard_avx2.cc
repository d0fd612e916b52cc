// AVX2 (+F16C) kernels of kernels/hadamard.h. This file alone is compiled with -mavx2 -mf16c
// (and -ffp-contract=off: a multiply followed by an add must stay two roundings, as in the scalar
// kernel); nothing here runs unless HadamardIsaSupported(kAvx2) said yes.
//
// The 128 values sit in 16 registers of 8. Butterfly stages h = 1, 2, 4 pair lanes of one
// register (the partner comes from a permute), h = 8 .. 64 pair whole registers. Each value gets
// exactly the scalar kernel's operation: a + b where it is the lower element of its pair, a - b
// (the partner minus itself) where it is the upper one.
#include "kernels/hadamard.h"

#include "kernels/fp16.h"

#if defined(__x86_64__)
#include <immintrin.h>

namespace exl3 {
namespace {

// Lanes set in kUpper are the upper elements of their pairs.
template <int kUpper>
inline __m256 Butterfly(__m256 v, __m256 partner) {
  return _mm256_blend_ps(_mm256_add_ps(v, partner), _mm256_sub_ps(partner, v), kUpper);
}

inline void Butterflies(__m256 (&v)[16]) {
  for (int r = 0; r < 16; ++r) {
    v[r] = Butterfly<0xAA>(v[r], _mm256_permute_ps(v[r], _MM_SHUFFLE(2, 3, 0, 1)));  // h = 1
  }
  for (int r = 0; r < 16; ++r) {
    v[r] = Butterfly<0xCC>(v[r], _mm256_permute_ps(v[r], _MM_SHUFFLE(1, 0, 3, 2)));  // h = 2
  }
  for (int r = 0; r < 16; ++r) {  // h = 4: swap the 128-bit halves
    v[r] = Butterfly<0xF0>(v[r], _mm256_permute2f128_ps(v[r], v[r], 0x01));
  }
  for (int d = 1; d < 16; d <<= 1) {  // h = 8 d: registers r and r + d
    for (int r = 0; r < 16; ++r) {
      if (r & d) continue;
      const __m256 a = v[r], b = v[r + d];
      v[r] = _mm256_add_ps(a, b);
      v[r + d] = _mm256_sub_ps(a, b);
    }
  }
  const __m256 s = _mm256_set1_ps(kHadamard128Scale);
  for (int r = 0; r < 16; ++r) v[r] = _mm256_mul_ps(v[r], s);
}

void Hadamard128Avx2(float* p) {
  __m256 v[16];
  for (int r = 0; r < 16; ++r) v[r] = _mm256_loadu_ps(p + 8 * r);
  Butterflies(v);
  for (int r = 0; r < 16; ++r) _mm256_storeu_ps(p + 8 * r, v[r]);
}

void ScaleHadamard128Avx2(const float* x, const float* scale, float* out) {
  __m256 v[16];
  for (int r = 0; r < 16; ++r) {
    v[r] = _mm256_mul_ps(_mm256_loadu_ps(x + 8 * r), _mm256_loadu_ps(scale + 8 * r));
  }
  Butterflies(v);
  for (int r = 0; r < 16; ++r) _mm256_storeu_ps(out + 8 * r, v[r]);
}

void Hadamard128ScaleBiasAvx2(float* p, const float* scale, const float* bias) {
  __m256 v[16];
  for (int r = 0; r < 16; ++r) v[r] = _mm256_loadu_ps(p + 8 * r);
  Butterflies(v);
  for (int r = 0; r < 16; ++r) v[r] = _mm256_mul_ps(v[r], _mm256_loadu_ps(scale + 8 * r));
  if (bias != nullptr) {
    for (int r = 0; r < 16; ++r) v[r] = _mm256_add_ps(v[r], _mm256_loadu_ps(bias + 8 * r));
  }
  for (int r = 0; r < 16; ++r) _mm256_storeu_ps(p + 8 * r, v[r]);
}

void HalfToFloatAvx2(const uint16_t* h, float* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  }
  for (; i < n; ++i) out[i] = HalfBitsToFloat(h[i]);
}

}  // namespace

const HadamardKernels& HadamardKernelsAvx2() {
  static const HadamardKernels k = {Hadamard128Avx2, ScaleHadamard128Avx2,
                                    Hadamard128ScaleBiasAvx2, HalfToFloatAvx2};
  return k;
}

}  // namespace exl3

#else  // not x86-64: never selected (HadamardIsaSupported says no).

namespace exl3 {
const HadamardKernels& HadamardKernelsAvx2() { return HadamardKernelsFor(HadamardIsa::kScalar); }
}  // namespace exl3

#endif
