// Rows of a hashed n-gram table as exllamav3 quantizes it (its "exl3_ngram_trellis" format:
// conversion/ngram.py and modules/quant/exl3_lib/ngram_codec.py of its wheel; Qwen4-Exp's PLE
// table `ple_embedding.ngram_embedding.shard_N.trellis`, int16 [rows, 1 + dim * K / 16]).
//
// A row is one tail-biting trellis ring over the mul1 codebook: word 0 holds an fp16 scale, the
// other words a bitstream of dim * K bits (little-endian within each 16-bit word) whose bits
// [i K, (i + 1) K) are the low K bits of position i's 16-bit state; the state's higher bits are
// the symbols of positions i - 1, i - 2, ... (K bits each, wrapping around the row). Decoded:
//
//   row[i] = mul1(state_i) * scale + head_bias[head of the row][i]
//
// with head_bias fp16 [heads, dim] (`ngram_embedding.head_bias`) and the rows of head h starting
// at `ngram_embedding.head_offsets`[h].
#pragma once

#include <cstdint>

namespace exl3 {

// Words per row of `dim` values at K bits: 1 + dim * K / 16.
int Exl3NgramWordsPerRow(int dim, int k);

// The K of a row of `words` int16 words holding `dim` values, or 0 when no K in 1..8 fits.
int Exl3NgramBits(int dim, int words);

// Decodes one row (words: Exl3NgramWordsPerRow(dim, k) of them; bias: the row's head's fp16
// bias [dim], or null) into out[dim] (fp32).
void DecodeExl3NgramRow(const uint16_t* words, int dim, int k, const uint16_t* bias, float* out);

}  // namespace exl3
