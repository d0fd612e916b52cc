#include "engine/sampling/sampler.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <numeric>

#include "base/mix64.h"

namespace exl3::engine {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Separates the seed's key from the plain value (the first fractional bits of sqrt(2)).
constexpr uint64_t kSeedSalt = 0x6a09e667f3bcc909ull;

// The largest value; eight running maxima keep the loop free of one long dependency chain.
float MaxValue(std::span<const float> v) {
  float m[8];
  std::fill(m, m + 8, kNegInf);
  size_t i = 0;
  for (; i + 8 <= v.size(); i += 8) {
    for (int j = 0; j < 8; ++j) m[j] = v[i + j] > m[j] ? v[i + j] : m[j];
  }
  for (; i < v.size(); ++i) m[0] = v[i] > m[0] ? v[i] : m[0];
  return *std::max_element(m, m + 8);
}

// The smallest value above -inf (-inf when there is none), with eight running minima.
float MinFiniteValue(std::span<const float> v) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  float m[8];
  std::fill(m, m + 8, kInf);
  size_t i = 0;
  for (; i + 8 <= v.size(); i += 8) {
    for (int j = 0; j < 8; ++j) m[j] = v[i + j] > kNegInf && v[i + j] < m[j] ? v[i + j] : m[j];
  }
  for (; i < v.size(); ++i) m[0] = v[i] > kNegInf && v[i] < m[0] ? v[i] : m[0];
  const float lowest = *std::min_element(m, m + 8);
  return lowest == kInf ? kNegInf : lowest;
}

// exp(x) for x <= 0 within 4e-6 relative (the float reduction of x log2 e; about 1e-7 near 0,
// where the probability mass is), x below -87 giving exp(-87); from plain float
// arithmetic that the compiler vectorizes: 2^(x log2 e) split into 2^n 2^f, |f| <= 1/2, with
// 2^f from its degree-7 Taylor polynomial.
inline float ExpNonPositive(float x) {
  // The clamp in integers: a float select would stop vectorization (it may trap). For x <= 0,
  // the bit patterns of +0, then -0 to -inf, grow with the magnitude.
  constexpr uint32_t kMinus87 = std::bit_cast<uint32_t>(-87.0f);
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  x = std::bit_cast<float>(bits < kMinus87 ? bits : kMinus87);
  const float t = x * 1.44269504f;
  const float n = (t + 12582912.0f) - 12582912.0f;  // round to nearest: 1.5 * 2^23 trick
  const float f = t - n;
  float p = 1.52527338e-5f;
  p = p * f + 1.54035304e-4f;
  p = p * f + 1.33335581e-3f;
  p = p * f + 9.61812911e-3f;
  p = p * f + 5.55041087e-2f;
  p = p * f + 2.40226507e-1f;
  p = p * f + 6.93147181e-1f;
  p = p * f + 1.0f;
  const int32_t biased = static_cast<int32_t>(n) + 127;  // in [1, 127]
  return p * std::bit_cast<float>(biased << 23);
}

// out[t] = ExpNonPositive(x[t] - shift) for t < n: the sampler's widest loop over a row. On x86-64
// a second copy for AVX2 is chosen at load time where the CPU has it (eight lanes instead of
// four); the lanes run the same float operations (no FMA: AVX2 alone has none, and the file is
// compiled with -ffp-contract=off), so both copies give the same bits.
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("avx2", "default")))
#endif
void ExpShifted(const float* x, float shift, float* out, int32_t n) {
  for (int32_t t = 0; t < n; ++t) out[t] = ExpNonPositive(x[t] - shift);
}

// The lowest index of the largest value.
int32_t ArgMax(std::span<const float> logits) {
  const float m = MaxValue(logits);
  for (size_t t = 0; t < logits.size(); ++t) {
    if (logits[t] == m) return static_cast<int32_t>(t);
  }
  return 0;  // NaN logits: nothing compares equal
}

constexpr size_t kMaxBuckets = 2048;

}  // namespace

Sampler::Sampler(int vocab_size)
    : vocab_size_(vocab_size),
      weights_(vocab_size, 0.0f),
      output_counts_(vocab_size, 0),
      seen_(vocab_size, 0) {
  candidates_.reserve(vocab_size);
}

double Sampler::UniformDraw(uint64_t seed, uint64_t draw_index) {
  // splitmix64's stream of a key derived from the seed, at position draw_index + 1: for one seed
  // every index gives a different output (Mix64 is a bijection of key + n * gamma), and seed and
  // index never cancel (they are not combined symmetrically). The 53 bits are centred in their
  // interval, so u is never 0 and never 1.
  const uint64_t key = Mix64(seed ^ kSeedSalt);
  const uint64_t bits = Mix64(key + (draw_index + 1) * kGoldenGamma);
  return (static_cast<double>(bits >> 11) + 0.5) * 0x1.0p-53;
}

SampledToken Sampler::Sample(std::span<float> logits, const SamplingParams& params, uint64_t seed,
                             const SequenceHistory& history) {
  if (!history.allowed_tokens.empty()) ApplyAllowedMask(logits, history.allowed_tokens);
  if (params.logprobs.has_value()) raw_.assign(logits.begin(), logits.end());
  for (const TokenBias& b : params.logit_bias) logits[b.token] += b.bias;
  for (int32_t t : history.banned_tokens) logits[t] = kNegInf;
  ApplyPenalties(logits, params, history);

  SampledToken out;
  if (params.greedy()) {
    out.token = ArgMax(logits);
  } else {
    out.token = Draw(logits, params, UniformDraw(seed, history.output.size()));
  }

  if (params.logprobs.has_value()) FillLogprobs(raw_, *params.logprobs, out);
  return out;
}

std::optional<SampledToken> Sampler::SampleAccepted(std::span<float> logits, const SamplingParams& params,
                                                    uint64_t seed, const SequenceHistory& history,
                                                    const std::function<bool(int32_t)>& accepts, int max_refusals) {
  row_as_given_.assign(logits.begin(), logits.end());
  allowed_.assign(history.allowed_tokens.begin(), history.allowed_tokens.end());
  SequenceHistory h = history;
  for (int refusals = 0;; ++refusals) {
    h.allowed_tokens = allowed_;
    const SampledToken out = Sample(logits, params, seed, h);
    if (accepts(out.token)) return out;
    if (refusals == max_refusals || allowed_.empty()) return std::nullopt;
    allowed_[static_cast<size_t>(out.token) / 32] &= ~(1u << (out.token % 32));
    // Another draw needs a token still allowed and not banned (else every logit is -inf).
    bool any = false;
    for (size_t word = 0; word < allowed_.size() && !any; ++word) {
      for (uint32_t bits = allowed_[word]; bits != 0 && !any; bits &= bits - 1) {
        const int32_t t = static_cast<int32_t>(word * 32 + std::countr_zero(bits));
        any = t < vocab_size_ && std::find(history.banned_tokens.begin(), history.banned_tokens.end(), t) ==
                                     history.banned_tokens.end();
      }
    }
    if (!any) return std::nullopt;
    std::copy(row_as_given_.begin(), row_as_given_.end(), logits.begin());
  }
}

void Sampler::FillLogprobs(std::span<const float> raw, int top_n_wanted, SampledToken& out) {
  const float max_raw = MaxValue(raw);
  // weights_ is free again: the exponentials in a loop that vectorizes, then four partial sums.
  ExpShifted(raw.data(), max_raw, weights_.data(), vocab_size_);
  double partial[4] = {0, 0, 0, 0};
  int32_t t = 0;
  for (; t + 4 <= vocab_size_; t += 4) {
    for (int j = 0; j < 4; ++j) partial[j] += weights_[t + j];
  }
  for (; t < vocab_size_; ++t) partial[0] += weights_[t];
  const double sum = partial[0] + partial[1] + partial[2] + partial[3];
  const float log_normalizer = max_raw + static_cast<float>(std::log(sum));
  out.logprob = raw[out.token] - log_normalizer;
  // The top N in one pass: a heap whose front is the lowest of the best N so far.
  const size_t top_n = std::clamp(top_n_wanted, 0, vocab_size_);
  auto higher = [&](int32_t a, int32_t b) { return Higher(raw, a, b); };
  candidates_.clear();
  // floor: the heap front's logit once the heap is full; a lower logit never enters, and most
  // tokens are skipped by that one comparison.
  float floor = kNegInf;
  for (int32_t t = 0; t < vocab_size_ && top_n > 0; ++t) {
    if (candidates_.size() < top_n) {
      candidates_.push_back(t);
      std::push_heap(candidates_.begin(), candidates_.end(), higher);
      if (candidates_.size() == top_n) floor = raw[candidates_.front()];
    } else if (!(raw[t] < floor) && higher(t, candidates_.front())) {
      std::pop_heap(candidates_.begin(), candidates_.end(), higher);
      candidates_.back() = t;
      std::push_heap(candidates_.begin(), candidates_.end(), higher);
      floor = raw[candidates_.front()];
    }
  }
  std::sort_heap(candidates_.begin(), candidates_.end(), higher);
  out.top_logprobs.reserve(top_n);
  for (int32_t t : candidates_) out.top_logprobs.push_back({t, raw[t] - log_normalizer});
}

SampledToken Sampler::PromptLogprobs(std::span<const float> logits, int32_t token, int top_n) {
  SampledToken out;
  out.token = token;
  FillLogprobs(logits, top_n, out);
  const float own = logits[token];
  int higher = 0;
  for (float v : logits) higher += v > own ? 1 : 0;
  out.rank = 1 + higher;
  return out;
}

void Sampler::ApplyAllowedMask(std::span<float> logits, std::span<const uint32_t> allowed) {
  const size_t n = logits.size();
  for (size_t word = 0; word * 32 < n; ++word) {
    const uint32_t w = word < allowed.size() ? allowed[word] : 0u;
    if (w == ~0u) continue;
    const size_t end = std::min(n, word * 32 + 32);
    for (size_t t = word * 32; t < end; ++t) {
      if (!((w >> (t - word * 32)) & 1u)) logits[t] = kNegInf;
    }
  }
}

void Sampler::ApplyPenalties(std::span<float> logits, const SamplingParams& params,
                             const SequenceHistory& history) {
  const bool repetition = params.repetition_penalty != 1.0f;
  const bool additive = params.presence_penalty != 0.0f || params.frequency_penalty != 0.0f;
  if (!repetition && !additive) return;
  touched_.clear();
  auto touch = [&](int32_t t) {
    if (!seen_[t]) {
      seen_[t] = 1;
      touched_.push_back(t);
    }
  };
  if (repetition) {
    for (int32_t t : history.prompt) touch(t);
  }
  for (int32_t t : history.output) {
    touch(t);
    ++output_counts_[t];
  }
  for (int32_t t : touched_) {
    float& l = logits[t];
    if (repetition && l != kNegInf) {
      l = l > 0 ? l / params.repetition_penalty : l * params.repetition_penalty;
    }
    const int count = output_counts_[t];
    if (additive && count > 0) {
      l -= params.presence_penalty + params.frequency_penalty * static_cast<float>(count);
    }
    seen_[t] = 0;
    output_counts_[t] = 0;
  }
}

bool Sampler::Higher(std::span<const float> logits, int32_t a, int32_t b) {
  return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
}

size_t Sampler::SelectHead(std::span<const float> logits, size_t n, float highest,
                           float lowest, size_t max_count, double mass_fraction) {
  // Buckets by logit, highest first; bucket order agrees with Higher, so every bucket before the
  // one where the head ends is kept whole and only that one is sorted. O(n) plus one bucket's
  // sort, where sorting everything would cost O(n log n) on flat distributions.
  const size_t num_buckets = std::clamp<size_t>(n / 16, 1, kMaxBuckets);
  const float scale = highest > lowest ? (num_buckets - 1) / (highest - lowest) : 0.0f;
  auto bucket = [&](int32_t t) {
    return std::min(num_buckets - 1, static_cast<size_t>((highest - logits[t]) * scale));
  };
  bucket_count_.assign(num_buckets, 0);
  bucket_mass_.assign(num_buckets, 0.0);
  double total = 0;
  for (size_t i = 0; i < n; ++i) {
    const size_t b = bucket(candidates_[i]);
    ++bucket_count_[b];
    bucket_mass_[b] += weights_[candidates_[i]];
    total += weights_[candidates_[i]];
  }
  const double target_mass = mass_fraction * total;
  size_t count_before = 0;
  double mass_before = 0;
  size_t last = 0;
  for (; last < num_buckets; ++last) {
    if (count_before + bucket_count_[last] >= max_count ||
        mass_before + bucket_mass_[last] >= target_mass) {
      break;
    }
    count_before += bucket_count_[last];
    mass_before += bucket_mass_[last];
  }
  if (last == num_buckets) return n;  // rounding: keep everything
  // Compacts the kept buckets to the front without branches (random data would mispredict
  // them), setting the last bucket's tokens aside; the lower buckets are dropped.
  boundary_.clear();
  size_t count = 0;
  for (size_t i = 0; i < n; ++i) {
    const int32_t t = candidates_[i];
    const size_t b = bucket(t);
    candidates_[count] = t;
    count += b < last;
    if (b == last) boundary_.push_back(t);
  }
  std::sort(boundary_.begin(), boundary_.end(),
            [&](int32_t a, int32_t b) { return Higher(logits, a, b); });
  size_t taken = 0;
  while (taken < boundary_.size()) {
    mass_before += weights_[boundary_[taken++]];
    if (count + taken >= max_count || mass_before >= target_mass) break;
  }
  // The head stays in ascending token id order (the draw walks it so, engine/sampling/sampler.h): the
  // taken boundary tokens, sorted by id, merge into the kept ones from the back.
  const size_t head = count + taken;
  std::sort(boundary_.begin(), boundary_.begin() + taken);
  size_t kept = count, out = head;
  while (taken > 0) {
    if (kept > 0 && candidates_[kept - 1] > boundary_[taken - 1]) {
      candidates_[--out] = candidates_[--kept];
    } else {
      candidates_[--out] = boundary_[--taken];
    }
  }
  return head;
}

int32_t Sampler::Draw(std::span<float> logits, const SamplingParams& params,
                      double uniform) {
  // Temperature, and the tokens still possible (banned ones are -inf), in one pass.
  const float inv_temperature = 1.0f / params.temperature;
  for (int32_t t = 0; t < vocab_size_; ++t) logits[t] *= inv_temperature;
  // Without a branch: every token is written, and the count moves past the possible ones.
  candidates_.resize(static_cast<size_t>(vocab_size_));
  size_t possible = 0;
  for (int32_t t = 0; t < vocab_size_; ++t) {
    candidates_[possible] = t;
    possible += logits[t] != kNegInf ? 1 : 0;
  }
  candidates_.resize(possible);
  if (candidates_.empty()) return 0;  // everything banned: nothing sensible left
  const float max_logit = MaxValue(logits);
  const float min_logit = MinFiniteValue(logits);
  // Unnormalized probabilities, computed once, over the whole row (a loop that vectorizes; the
  // -inf tokens are never read).
  ExpShifted(logits.data(), max_logit, weights_.data(), vocab_size_);

  // Each filter keeps a head of the candidates in Higher order (the top token always stays), so
  // they apply one after another to a shrinking count n; candidates_[0, n) stays in ascending
  // token id order throughout.
  constexpr double kNoMassLimit = std::numeric_limits<double>::infinity();
  size_t n = candidates_.size();
  if (params.top_k > 0 && static_cast<size_t>(params.top_k) < n) {
    n = SelectHead(logits, n, max_logit, min_logit, params.top_k, kNoMassLimit);
  }
  if (params.top_p < 1.0f) n = SelectHead(logits, n, max_logit, min_logit, n, params.top_p);
  if (params.min_p > 0.0f) {
    // p / p_max >= min_p, and the ratio does not depend on the normalization.
    const float threshold = max_logit + std::log(params.min_p);
    // remove_if keeps the order of what stays (ascending token ids).
    auto end = std::remove_if(candidates_.begin(), candidates_.begin() + n,
                              [&](int32_t t) { return !(logits[t] >= threshold); });
    n = end - candidates_.begin();
  }

  double total = 0;
  for (size_t i = 0; i < n; ++i) total += weights_[candidates_[i]];
  const double target = uniform * total;
  double cumulative = 0;
  for (size_t i = 0; i < n; ++i) {
    cumulative += weights_[candidates_[i]];
    if (target < cumulative) return candidates_[i];
  }
  return candidates_[n - 1];  // rounding at the top end
}

}  // namespace exl3::engine
