// Internal to the CPU backend: the middle product y' = x' · W_inner over a strip of column tiles,
// decoding the trellis on the fly. x' is the input after ApplyInputTransform.
#pragma once

#include <cstddef>
#include <vector>

#include "base/scratch.h"
#include <cstdint>
#include <cstring>

#include "kernels/exl3_linear.h"

namespace exl3::cpu {

// Both SIMD paths decode a tile from an extended copy of its 8K words with one word of wrap-around
// on each side: ext[0] = u32[8K-1], ext[1..8K] = u32[0..8K-1], ext[8K+1] = u32[0]. Stream bit b
// then sits at extended bit b + 32, and every element's 16-bit state window lies in two adjacent
// words (tail-biting included).
template <int K>
inline void FillExtendedTile(const Exl3LinearView& w, int i, int j, uint32_t* ext) {
  constexpr int kWords = 8 * K;
  std::memcpy(ext + 1, reinterpret_cast<const uint32_t*>(w.tile(i, j)), kWords * 4);
  ext[0] = ext[kWords];
  ext[kWords + 1] = ext[1];
}

// Where element e's state window starts in the extended buffer: word `word`, bit `shift` (the
// window is (ext[word] << shift) | (ext[word + 1] >> (32 - shift)), top 16 bits).
struct StateWindowPos {
  int word, shift;
};
inline StateWindowPos StateWindow(int e, int K) {
  const int s = (e + 1) * K - 16 + 32;
  return {s >> 5, s & 31};
}

// Scalar: xt [T, k] row-major; writes y [T, n] columns 16*j0 .. 16*j1-1 (overwrites them).
void InnerProductScalar(const Exl3LinearView& w, const float* xt, int num_tokens, int j0, int j1,
                        float* y);

// AVX2 (+FMA, F16C) path; only call when Avx2Supported(). The input is first rearranged by
// Avx2PrepareX into Avx2PreparedFloats(T, k) floats ([k/16][T][32]: the decoder's lane order,
// tile row major).
bool Avx2Supported();
size_t Avx2PreparedFloats(int num_tokens, int k);
void Avx2PrepareX(const float* xt, int num_tokens, int k, float* xp);
void InnerProductAvx2(const Exl3LinearView& w, const float* xp, int num_tokens, int j0, int j1,
                      float* y);

// AVX-512F path over the same prepared layout; only call when Avx512Supported(). With several
// tokens it decodes chunks of up to kAvx512BufferTiles tiles of the strip at once (rows of all its
// column tiles) and keeps accumulators in registers over a chunk's rows.
inline constexpr int kAvx512BufferTiles = 16;
bool Avx512Supported();
void InnerProductAvx512(const Exl3LinearView& w, const float* xp, int num_tokens, int j0, int j1,
                        float* y);

// The same with AVX512-VBMI (byte permutes cut the states); only call when
// Avx512VbmiSupported(). Same results to the bit.
bool Avx512VbmiSupported();
// (The kernels' per-thread accumulators grow with the tokens of a call, [T][S][...] floats; each
// kernel gives them back after a call that grew them past kKeepScratchBytes, base/scratch.h.)
void InnerProductAvx512Vbmi(const Exl3LinearView& w, const float* xp, int num_tokens, int j0,
                            int j1, float* y);

}  // namespace exl3::cpu
