#include "kernels/hadamard.h"

#include <cmath>

namespace exl3 {

namespace {
const float kScale = 1.0f / std::sqrt(128.0f);
}

void Hadamard128(float* v) {
  for (int h = 1; h < kHadamardBlock; h <<= 1) {
    for (int i = 0; i < kHadamardBlock; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        const float a = v[j], b = v[j + h];
        v[j] = a + b;
        v[j + h] = a - b;
      }
    }
  }
  for (int i = 0; i < kHadamardBlock; ++i) v[i] *= kScale;
}

void HadamardBlocks(float* v, size_t len) {
  for (size_t off = 0; off + kHadamardBlock <= len; off += kHadamardBlock) Hadamard128(v + off);
}

void Hadamard128Strided(float* v, size_t stride) {
  float tmp[kHadamardBlock];
  for (int i = 0; i < kHadamardBlock; ++i) tmp[i] = v[i * stride];
  Hadamard128(tmp);
  for (int i = 0; i < kHadamardBlock; ++i) v[i * stride] = tmp[i];
}

}  // namespace exl3
