#include "engine/cpu/residual/ngram_hash.h"

namespace exl3::engine {
namespace {

constexpr uint64_t kSplitMixGamma = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kLayerSeedStride = 10007;  // seed of PLE layer k: seed + 10007 k

bool IsPrime(int64_t v) {
  if (v < 2) return false;
  if (v % 2 == 0) return v == 2;
  for (int64_t d = 3; d * d <= v; d += 2)
    if (v % d == 0) return false;
  return true;
}

}  // namespace

uint64_t SplitMix64(uint64_t v) {
  v += kSplitMixGamma;
  v = (v ^ (v >> 30)) * 0xBF58476D1CE4E5B9ull;
  v = (v ^ (v >> 27)) * 0x94D049BB133111EBull;
  return v ^ (v >> 31);
}

NgramHash NgramHash::Build(const PleConfig& ple, int vocab_size, int ple_index) {
  NgramHash h;
  h.ngram_size_ = ple.ngram_size;
  h.heads_per_ngram_ = ple.heads_per_ngram;
  h.eos_ = ple.eos_token_id;
  // Odd multipliers below (2^63 - 1) / vocab: token * multiplier stays below 2^63.
  const uint64_t max_multiplier = ((uint64_t{1} << 63) - 1) / static_cast<uint64_t>(vocab_size > 1 ? vocab_size : 1);
  const uint64_t half_bound = max_multiplier / 2 > 0 ? max_multiplier / 2 : 1;
  const uint64_t base_seed = static_cast<uint64_t>(ple.seed) + kLayerSeedStride * static_cast<uint64_t>(ple_index);
  for (int i = 0; i < ple.ngram_size; ++i)
    h.multipliers_.push_back(2 * (SplitMix64(base_seed + kSplitMixGamma * (i + 1)) % half_bound) + 1);
  // Head k of this layer: the (ple_index * heads + k + 1)-th prime >= vocab_size_base.
  const int heads = ple.num_heads();
  const int64_t first_global = static_cast<int64_t>(ple_index) * heads;
  int64_t candidate = ple.vocab_size_base - 1, primes_seen = 0, offset = 0;
  while (static_cast<int>(h.head_sizes_.size()) < heads) {
    do ++candidate;
    while (!IsPrime(candidate));
    if (primes_seen++ < first_global) continue;
    h.head_sizes_.push_back(candidate);
    h.head_offsets_.push_back(offset);
    offset += candidate;
  }
  h.table_rows_ = (offset + ple.vocab_divisor - 1) / ple.vocab_divisor * ple.vocab_divisor;
  return h;
}

void NgramHash::Rows(const int32_t* window, int64_t* rows) const {
  const int n = ngram_size_;
  // shifted[s]: the token s back, or eos when an eos lies in window[n-1-s .. n-2].
  uint64_t mixed_terms[16];
  bool eos_seen = false;
  for (int s = 0; s < n; ++s) {
    int32_t token = window[n - 1 - s];
    if (s > 0) {
      eos_seen = eos_seen || token == eos_;
      if (eos_seen) token = eos_;
    }
    mixed_terms[s] = static_cast<uint64_t>(token) * multipliers_[s];
  }
  int out = 0;
  uint64_t mix = mixed_terms[0];
  for (int order = 2; order <= n; ++order) {
    mix ^= mixed_terms[order - 1];
    for (int k = 0; k < heads_per_ngram_; ++k, ++out)
      rows[out] = static_cast<int64_t>(mix % static_cast<uint64_t>(head_sizes_[out])) + head_offsets_[out];
  }
}

}  // namespace exl3::engine
