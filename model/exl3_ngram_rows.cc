#include "model/exl3_ngram_rows.h"

#include "kernels/codebook.h"
#include "kernels/fp16.h"

namespace exl3 {

int Exl3NgramWordsPerRow(int dim, int k) { return 1 + dim * k / 16; }

int Exl3NgramBits(int dim, int words) {
  for (int k = 1; k <= 8; ++k)
    if (dim * k % 16 == 0 && Exl3NgramWordsPerRow(dim, k) == words) return k;
  return 0;
}

void DecodeExl3NgramRow(const uint16_t* words, int dim, int k, const uint16_t* bias, float* out) {
  const float scale = HalfBitsToFloat(words[0]);
  const uint16_t* stream = words + 1;
  const int stream_words = dim * k / 16;
  const uint32_t mask = (1u << k) - 1;
  // Position i's symbol: stream bits [i k, (i + 1) k), read through a two-word window.
  auto symbol = [&](int i) {
    const int bit = i * k, w = bit >> 4;
    const uint32_t window = stream[w] | (static_cast<uint32_t>(stream[(w + 1) % stream_words]) << 16);
    return (window >> (bit & 15)) & mask;
  };
  const float* table = CodebookTable(Codebook::kMul1);
  const int stacked = (15 + k) / k;  // symbols that reach into a 16-bit state
  for (int i = 0; i < dim; ++i) {
    uint32_t state = 0;
    for (int j = 0; j < stacked; ++j) state |= symbol(((i - j) % dim + dim) % dim) << (j * k);
    out[i] = table[state & 0xffffu] * scale + (bias != nullptr ? HalfBitsToFloat(bias[i]) : 0.0f);
  }
}

}  // namespace exl3
