// Bit-exact IEEE binary16 and bfloat16 conversions for the CPU side (round to nearest even).
#pragma once

#include <cstdint>
#include <cstring>

namespace exl3 {

inline float HalfBitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while ((man & 0x400u) == 0);
      bits = sign | (static_cast<uint32_t>(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Rounds a double to the nearest binary16 (ties to even). Used where exactly one fp16 rounding
// of an exact intermediate is required (the codebooks' fp16 add and fma).
inline uint16_t DoubleToHalfBits(double d) {
  uint64_t bits;
  std::memcpy(&bits, &d, 8);
  const uint16_t sign = static_cast<uint16_t>((bits >> 48) & 0x8000u);
  const int exp = static_cast<int>((bits >> 52) & 0x7ff);
  uint64_t man = bits & 0xfffffffffffffull;
  if (exp == 0x7ff) return sign | 0x7c00u | (man ? 0x200u : 0u);
  const int e = exp - 1023;  // unbiased exponent
  if (e > 15) return sign | 0x7c00u;
  // Full significand with implicit bit (for normals).
  uint64_t sig = (exp == 0) ? man : (man | (1ull << 52));
  int shift;  // how many low bits of sig to drop
  uint16_t hexp;
  if (e >= -14) {
    shift = 52 - 10;
    hexp = static_cast<uint16_t>(e + 15);
  } else {
    shift = 52 - 10 + (-14 - e);  // subnormal half
    hexp = 0;
    if (shift > 63) return sign;
  }
  uint64_t keep = sig >> shift;
  const uint64_t rem = sig & ((1ull << shift) - 1);
  const uint64_t half = 1ull << (shift - 1);
  if (rem > half || (rem == half && (keep & 1))) ++keep;
  if (hexp == 0) return sign | static_cast<uint16_t>(keep);  // may carry into the normal range: fine
  // keep holds 11 bits (implicit one at bit 10), possibly 12 after rounding carry.
  if (keep & 0x800u) {
    keep >>= 1;
    ++hexp;
    if (hexp >= 31) return sign | 0x7c00u;
  }
  return sign | static_cast<uint16_t>(hexp << 10) | static_cast<uint16_t>(keep & 0x3ffu);
}

inline uint16_t FloatToHalfBits(float f) { return DoubleToHalfBits(static_cast<double>(f)); }

// bfloat16: the high half of an fp32.
inline float BFloat16BitsToFloat(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Rounds to the nearest bfloat16 (ties to even); NaN stays NaN.
inline uint16_t FloatToBFloat16Bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace exl3
