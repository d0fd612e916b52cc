// Internal to the CPU backend: the middle product y' = x' · W_inner over a strip of column tiles,
// decoding the trellis on the fly. x' is the input after ApplyInputTransform.
#pragma once

#include <cstddef>

#include "kernels/exl3_linear.h"

namespace exl3::cpu {

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

// AVX-512F path over the same prepared layout; only call when Avx512Supported().
bool Avx512Supported();
void InnerProductAvx512(const Exl3LinearView& w, const float* xp, int num_tokens, int j0, int j1,
                        float* y);

}  // namespace exl3::cpu
