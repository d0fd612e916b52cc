// Viterbi encoder for EXL3 trellis tiles: 256 values (stream order) -> 16*K int16 words that
// kernels/trellis_tile.h decodes back to the encoder's chosen values, bit for bit.
//
// The trellis: stream element e is decoded from the 16-bit state made of stream bits
// (e+1)K-16 .. (e+1)K-1, so state_e = ((state_{e-1} << K) | next K bits) & 0xffff, and the
// stream is cyclic (state_0 continues from state_255: tail-biting). Every state has 2^K
// predecessors (those whose low 16-K bits equal its high 16-K bits).
//
// Encoding a tile is two Viterbi passes over all 65536 states:
//   1. unconstrained, from free (zero) costs, over the tile read circularly for 2W elements
//      with the wrap-around point 255 -> 0 in the middle (W = 256: a full lap before the wrap,
//      unrecorded, then a full lap after it, recorded); backtracking from the end to the wrap
//      point gives a well-informed guess of the 16-K overlap bits there;
//   2. the real pass over elements 0..255 with state_0's high bits and state_255's low bits
//      both fixed to that overlap (the exact optimum under that constraint).
// On Gaussian tiles this reaches the exact tail-biting optimum (best over all overlaps) on
// nearly every tile (tests check it at K = 6..8; bench/results/encoder.md measures it). Shorter
// windows are faster and worse: W = 128 (the tile once, rotated) lost 0.1-0.7 % of MSE at
// K = 1..4 and up to 0.07 % at K = 6; W = 64 lost 0.1-0.3 % at K = 6. Both passes are
// vectorised (AVX-512 or AVX2+FMA, runtime dispatch) with a portable fallback. The environment
// variable EXL3_ENCODER_WINDOW (8..256) overrides W, for experiments.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/codebook.h"
#include "kernels/trellis_tile.h"

namespace exl3 {

// Per-thread encoder state (scratch buffers). Not thread-safe; make one per thread.
class TileEncoder {
 public:
  // Which Viterbi step to use. kBest: AVX-512 where the CPU has it, else AVX2+FMA, else portable.
  // The AVX2 and AVX-512 steps give bit-identical output; the portable one computes d*d + m
  // without fma, so near-ties may break differently (tests compare the errors).
  enum class Simd { kBest, kPortable, kAvx2, kAvx512 };

  // K in 1..8. A SIMD level the CPU lacks falls back to the next lower one.
  explicit TileEncoder(int K, Codebook cb, Simd simd = Simd::kBest);
  ~TileEncoder();
  TileEncoder(const TileEncoder&) = delete;
  TileEncoder& operator=(const TileEncoder&) = delete;

  // Pass 1's W (see the top of this file), clamped to 8..256; for experiments and the bench.
  void set_window(int W);
  int window() const { return window_; }

  // Whether this CPU runs `simd` (kPortable and kBest: always).
  static bool SimdAvailable(Simd simd);
  Simd simd() const { return simd_; }

  int bits() const { return K_; }
  Codebook codebook() const { return cb_; }

  // Encodes 256 values given in stream order into 16*K words (the tile's trellis slice).
  // If `decoded` is non-null it receives the chosen codebook values in stream order (exactly
  // what the decoder will produce). Returns the sum of squared errors over the tile.
  double Encode(const float* x_stream, uint16_t* words, float* decoded = nullptr);

  // Pass 2 alone: the optimal tail-biting path whose wrap-around overlap (the low 16-K bits of
  // state 255 = the high 16-K bits of state 0) is `overlap`. Encode = this with pass 1's guess;
  // the minimum over all overlaps is the true optimum (tests check Encode against it at K = 8).
  double EncodeWithOverlap(const float* x_stream, uint32_t overlap, uint16_t* words,
                           float* decoded = nullptr);

  // The exact tail-biting optimum (up to float rounding), for tests and the bench: the best
  // EncodeWithOverlap over all 2^(16-K) overlaps, found by branch and bound (an unconstrained
  // pass gives a lower bound per overlap; overlaps are tried best bound first until the bound
  // reaches the best error found). Typically tens to a few hundred passes per tile, so 10-100x
  // the cost of Encode. `passes` (optional) receives the number of constrained passes run.
  double EncodeOptimal(const float* x_stream, uint16_t* words, float* decoded = nullptr,
                       int* passes = nullptr);

 private:
  // One pass of the Viterbi recursion over `num` values of `x`, starting from incoming costs
  // m_ (indexed by the overlap bits); leaves the final incoming costs in m_. With `record`,
  // stores per step the argmin predecessor (high K bits) for every overlap value into bp_.
  void Pass(const float* x, int num, bool record);
  // Walks back through bp_ from the state of the last step; fills states[0..num).
  void Backtrack(int num, uint32_t last_state, uint32_t* states) const;

  int K_;
  Codebook cb_;
  const float* table_;
  int R_;                     // 2^(16-K): number of overlap values
  std::vector<float> m_;      // incoming cost per overlap value (+ padding)
  std::vector<float> m_next_;
  std::vector<uint8_t> bp_;   // [256][R_] argmin high bits
  Simd simd_;                 // the step actually used (never kBest)
  int window_ = 256;          // pass 1 runs W elements before the wrap point and W after
};

// Packs 256 states (stream order) into 16*K words. The states must be consistent: the high
// 16-K bits of state e equal the low 16-K bits of state e-1 (cyclically).
void PackTileStates(const uint32_t* states, int K, uint16_t* words);

// Tile (i, j) of a row-major [rows, cols] matrix, gathered into stream order.
void GatherTileStream(const float* matrix, size_t cols, int tile_row, int tile_col,
                      float out[kTileElems]);
// Scatters a stream-order tile back into a row-major matrix.
void ScatterTileStream(const float in[kTileElems], float* matrix, size_t cols, int tile_row,
                       int tile_col);

// Encodes `num_tiles` tiles (each 256 floats in stream order, consecutive) on `threads` threads
// (0: hardware concurrency). words_out gets 16*K words per tile; decoded_out (optional) the
// chosen values per tile in stream order. Returns the total squared error.
double EncodeTiles(const float* x_stream, size_t num_tiles, int K, Codebook cb,
                   uint16_t* words_out, float* decoded_out, int threads);

}  // namespace exl3
