// Decoding one 16x16 EXL3 trellis tile: bit order, tail-biting states, fragment permutation.
#pragma once

#include <cstdint>

#include "kernels/codebook.h"

namespace exl3 {

inline constexpr int kTileSize = 16;
inline constexpr int kTileElems = 256;

// Row and column inside the tile of stream element e (tensor-core fragment order).
struct TilePos {
  int row;
  int col;
};
inline TilePos StreamElementPosition(int e) {
  const int t = e >> 3, j = e & 7;
  const int r0 = 2 * (t & 3), c0 = t >> 2;
  return {r0 + (j & 1) + ((j & 2) ? 8 : 0), c0 + ((j & 4) ? 8 : 0)};
}

// The 16-bit state of stream element e of a tile whose packed bits are `words` (16*K int16 words).
uint32_t TileState(const uint16_t* words, int K, int e);

// Decodes one tile into fp16 bit patterns in row-major tile order (out[row*16 + col]).
void DecodeTileHalf(const uint16_t* words, int K, Codebook cb, uint16_t out[kTileElems]);

// Decodes one tile into floats, row-major, using the codebook table (fast path).
void DecodeTileFloat(const uint16_t* words, int K, const float* table, float out[kTileElems]);

}  // namespace exl3
