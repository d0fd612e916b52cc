// EXL3 procedural codebooks: one 16-bit trellis state -> one fp16 weight (CPU, bit-exact).
#pragma once

#include <cstdint>
#include <string_view>

#include "kernels/fp16.h"

namespace exl3 {

enum class Codebook : int { k3Inst = 0, kMcg = 1, kMul1 = 2 };

inline constexpr uint32_t kMcgMultiplier = 0xCBAC1FEDu;
inline constexpr uint32_t kMul1Multiplier = 0x83DCD12Du;
inline constexpr uint32_t k3InstMultiplier = 89226354u;
inline constexpr uint32_t k3InstAddend = 64248484u;

std::string_view CodebookName(Codebook cb);  // "3inst", "mcg", "mul1"
bool ParseCodebook(std::string_view name, Codebook* out);

// Returns the fp16 bit pattern the codebook assigns to `state` (only the low 16 bits are used).
inline uint16_t DecodeStateHalf(uint32_t state, Codebook cb) {
  state &= 0xffffu;
  if (cb == Codebook::kMul1) {
    const uint32_t x = state * kMul1Multiplier;
    const uint32_t byte_sum = (x & 0xffu) + ((x >> 8) & 0xffu) + ((x >> 16) & 0xffu) + (x >> 24);
    const double h = 1024.0 + byte_sum;  // fp16 0x6400 + byte_sum is exactly 1024 + byte_sum
    static const double kScale = HalfBitsToFloat(0x1eee);
    static const double kBias = HalfBitsToFloat(0xc931);
    return DoubleToHalfBits(h * kScale + kBias);  // exact in double, so one fp16 rounding
  }
  uint32_t x = (cb == Codebook::kMcg) ? state * kMcgMultiplier
                                      : state * k3InstMultiplier + k3InstAddend;
  x = (x & 0x8fff8fffu) ^ 0x3b603b60u;
  const double lo = HalfBitsToFloat(static_cast<uint16_t>(x & 0xffffu));
  const double hi = HalfBitsToFloat(static_cast<uint16_t>(x >> 16));
  return DoubleToHalfBits(lo + hi);  // exact in double, so one fp16 rounding
}

// A 65536-entry table of every state's value as float, per codebook; built once on first use.
const float* CodebookTable(Codebook cb);

}  // namespace exl3
