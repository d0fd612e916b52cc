#include "kernels/trellis_tile.h"

namespace exl3 {
namespace {

// Reads the tile's stream as 32-bit words: u32[m] = u16[2m] | u16[2m+1] << 16.
inline uint32_t StreamWord(const uint16_t* words, int m) {
  return static_cast<uint32_t>(words[2 * m]) | (static_cast<uint32_t>(words[2 * m + 1]) << 16);
}

// 16 stream bits starting at bit position `start` (0 <= start < 256*K), first bit most significant.
// Bit b of the stream is bit 31 - (b % 32) of u32[b / 32]; positions wrap (tail-biting).
inline uint32_t StreamBits16(const uint16_t* words, int K, int start) {
  const int num_words = 8 * K;
  const int m = start >> 5;
  const uint64_t window = (static_cast<uint64_t>(StreamWord(words, m)) << 32) |
                          StreamWord(words, (m + 1) % num_words);
  return static_cast<uint32_t>(window >> (48 - (start & 31))) & 0xffffu;
}

}  // namespace

uint32_t TileState(const uint16_t* words, int K, int e) {
  const int total = kTileElems * K;
  int start = (e + 1) * K - 16;
  if (start < 0) start += total;
  return StreamBits16(words, K, start);
}

void DecodeTileHalf(const uint16_t* words, int K, Codebook cb, uint16_t out[kTileElems]) {
  for (int e = 0; e < kTileElems; ++e) {
    const TilePos p = StreamElementPosition(e);
    out[p.row * kTileSize + p.col] = DecodeStateHalf(TileState(words, K, e), cb);
  }
}

void DecodeTileFloat(const uint16_t* words, int K, const float* table, float out[kTileElems]) {
  for (int e = 0; e < kTileElems; ++e) {
    const TilePos p = StreamElementPosition(e);
    out[p.row * kTileSize + p.col] = table[TileState(words, K, e)];
  }
}

}  // namespace exl3
