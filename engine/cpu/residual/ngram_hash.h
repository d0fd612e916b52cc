// Qwen4-Exp's hashed n-gram rows (docs/engine.md, "Qwen4-Exp"): which rows of a PLE layer's
// n-gram embedding table a token reads, from the token and the ngram_size - 1 tokens before it.
//
//   NgramHash hash = NgramHash::Build(cfg.qwen4exp->ple, cfg.vocab_size, /*ple_index=*/0);
//   int32_t window[3] = {prev2, prev1, token};          // eos before the sequence's start
//   std::vector<int64_t> rows(hash.num_heads());
//   hash.Rows(window, rows.data());                     // row of each n-gram head, ascending n
//
// Per position, shift s (0..ngram_size-1) reads the token s back, or eos when that token or one
// between it and the position is eos (an n-gram never reaches across an end of sequence). For
// n = 2..ngram_size: mix = XOR over s < n of token_s * multiplier_s (64-bit; the multipliers are
// odd and small enough that no product overflows), and head h of that order reads row
// mix mod prime_h + offset_h. The multipliers come from splitmix64 of seed + 10007 * ple_index;
// head h of PLE layer k has the (k * heads + h + 1)-th prime >= ngram_vocab_size_base rows,
// placed after the heads before it; the table is padded to a multiple of the divisor.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/config/qwen4exp_config.h"

namespace exl3::engine {

class NgramHash {
 public:
  static NgramHash Build(const PleConfig& ple, int vocab_size, int ple_index);

  int num_heads() const { return static_cast<int>(head_sizes_.size()); }
  int64_t table_rows() const { return table_rows_; }  // padded
  const std::vector<uint64_t>& multipliers() const { return multipliers_; }
  const std::vector<int64_t>& head_sizes() const { return head_sizes_; }
  // `window`: ngram_size tokens, the oldest first and the position's own token last. Writes
  // num_heads() rows.
  void Rows(const int32_t* window, int64_t* rows) const;

 private:
  int ngram_size_ = 0;
  int heads_per_ngram_ = 0;
  int32_t eos_ = 0;
  std::vector<uint64_t> multipliers_;  // [ngram_size]
  std::vector<int64_t> head_sizes_;    // [num_heads] primes
  std::vector<int64_t> head_offsets_;  // [num_heads]
  int64_t table_rows_ = 0;
};

// splitmix64's output function of `value` (the increment added first).
uint64_t SplitMix64(uint64_t value);

}  // namespace exl3::engine
