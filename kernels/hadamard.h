// Fast Walsh-Hadamard transform over 128-element blocks, scaled by 1/sqrt(128) (orthonormal).
//
// Every call runs the best kernel the CPU has (AVX-512F, AVX2, or scalar, chosen at run time).
// All kernels do the same butterflies in the same pairing and order with the same fp32
// operations, so their results are bit-identical to the scalar one (tests/kernels/hadamard_test).
#pragma once

#include <cstddef>
#include <cstdint>

namespace exl3 {

inline constexpr int kHadamardBlock = 128;

// In place: v[0..127] <- v · (H128 / sqrt(128)), H128 the Sylvester matrix in natural order.
void Hadamard128(float* v);

// Applies Hadamard128 to each consecutive 128-block of v[0..len); len must be a multiple of 128.
void HadamardBlocks(float* v, size_t len);

// Same on a strided vector: element i is v[i * stride] (used for columns of a row-major matrix).
void Hadamard128Strided(float* v, size_t stride);

// The kernels per instruction set, for the linear layer's transforms and for tests.
enum class HadamardIsa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

struct HadamardKernels {
  // Hadamard128 above: butterflies h = 1, 2, ..., 64 (pairs j, j + h), then each value times
  // kHadamard128Scale.
  void (*hadamard128)(float* v);
  // out[0..127] = Hadamard128(x ⊙ scale): each x[i] * scale[i] rounded to fp32 first.
  void (*scale_hadamard128)(const float* x, const float* scale, float* out);
  // In place: v <- Hadamard128(v) ⊙ scale, then + bias when bias is not null (two roundings,
  // never fused into one fma).
  void (*hadamard128_scale_bias)(float* v, const float* scale, const float* bias);
  // out[i] = the fp16 value h[i] as fp32 (exact; as HalfBitsToFloat, except that the SIMD
  // kernels return a signalling NaN quieted).
  void (*half_to_float)(const uint16_t* h, float* out, size_t n);
};

// The scale applied after the butterflies: 1.0f / std::sqrt(128.0f) in fp32 (the test checks it).
inline constexpr float kHadamard128Scale = 0x1.6a09e6p-4f;

bool HadamardIsaSupported(HadamardIsa isa);
// The best instruction set this CPU supports.
HadamardIsa BestHadamardIsa();
// Kernels of one instruction set; only call them when HadamardIsaSupported(isa).
const HadamardKernels& HadamardKernelsFor(HadamardIsa isa);
// Kernels of BestHadamardIsa() (what the calls above use).
const HadamardKernels& ActiveHadamardKernels();

// Implemented in hadamard_avx2.cc / hadamard_avx512.cc (compiled with those ISA flags).
const HadamardKernels& HadamardKernelsAvx2();
const HadamardKernels& HadamardKernelsAvx512();

}  // namespace exl3
