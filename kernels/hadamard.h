// Fast Walsh-Hadamard transform over 128-element blocks, scaled by 1/sqrt(128) (orthonormal).
#pragma once

#include <cstddef>

namespace exl3 {

inline constexpr int kHadamardBlock = 128;

// In place: v[0..127] <- v · (H128 / sqrt(128)), H128 the Sylvester matrix in natural order.
void Hadamard128(float* v);

// Applies Hadamard128 to each consecutive 128-block of v[0..len); len must be a multiple of 128.
void HadamardBlocks(float* v, size_t len);

// Same on a strided vector: element i is v[i * stride] (used for columns of a row-major matrix).
void Hadamard128Strided(float* v, size_t stride);

}  // namespace exl3
