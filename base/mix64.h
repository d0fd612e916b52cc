// A 64-bit mixing function (splitmix64's finalizer): the engine's one building block for
// hashing (prefix-cache block hashes, engine/core/kv_block_manager.h) and for counter-based random
// numbers (engine/sampling/sampler.h).
//
//   uint64_t h = Mix64(parent ^ token);
#pragma once

#include <cstdint>

namespace exl3 {

constexpr uint64_t kGoldenGamma = 0x9e3779b97f4a7c15ull;

constexpr uint64_t Mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

}  // namespace exl3
