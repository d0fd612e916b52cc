#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "engine/mix64.h"

namespace exl3::engine {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The lowest index of the largest value.
int32_t ArgMax(std::span<const float> logits) {
  int32_t best = 0;
  for (int32_t t = 1; t < static_cast<int32_t>(logits.size()); ++t) {
    if (logits[t] > logits[best]) best = t;
  }
  return best;
}

// The smallest head of candidates[0, n) in `higher` order whose weight reaches `target`; it is
// moved to the front (in no particular order) and its size returned. Halving selection: O(n)
// expected, where sorting would cost O(n log n) on flat distributions.
template <typename Higher, typename Weight>
size_t TopPCount(std::vector<int32_t>& candidates, size_t n, double target, Higher higher,
                 Weight weight) {
  size_t lo = 0, hi = n;  // the boundary is in [lo, hi); everything before lo is kept
  double mass_before = 0;
  constexpr size_t kSortBelow = 64;
  while (hi - lo > kSortBelow) {
    const size_t mid = lo + (hi - lo) / 2;
    std::nth_element(candidates.begin() + lo, candidates.begin() + mid, candidates.begin() + hi,
                     higher);
    double upper = 0;
    for (size_t i = lo; i < mid; ++i) upper += weight(candidates[i]);
    if (mass_before + upper >= target) {
      hi = mid;
    } else {
      mass_before += upper;
      lo = mid;
    }
  }
  std::sort(candidates.begin() + lo, candidates.begin() + hi, higher);
  for (size_t i = lo; i < hi; ++i) {
    mass_before += weight(candidates[i]);
    if (mass_before >= target) return i + 1;
  }
  return hi;  // rounding: keep what is there
}

}  // namespace

Sampler::Sampler(int vocab_size)
    : vocab_size_(vocab_size),
      weights_(vocab_size, 0.0f),
      output_counts_(vocab_size, 0),
      seen_(vocab_size, 0) {
  candidates_.reserve(vocab_size);
}

double Sampler::UniformDraw(uint64_t seed, uint64_t draw_index) {
  const uint64_t bits = Mix64(Mix64(seed + kGoldenGamma) ^ Mix64(draw_index * kGoldenGamma + 1));
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
}

SampledToken Sampler::Sample(std::span<float> logits, const SamplingParams& params, uint64_t seed,
                             const SequenceHistory& history) {
  if (params.logprobs.has_value()) raw_.assign(logits.begin(), logits.end());
  for (int32_t t : history.banned_tokens) logits[t] = kNegInf;
  ApplyPenalties(logits, params, history);

  SampledToken out;
  if (params.temperature == 0.0f) {
    out.token = ArgMax(logits);
  } else {
    const float inv_temperature = 1.0f / params.temperature;
    for (float& l : logits) l *= inv_temperature;
    out.token = Draw(logits, params, UniformDraw(seed, history.output.size()));
  }

  if (params.logprobs.has_value()) {
    const float max_raw = *std::max_element(raw_.begin(), raw_.end());
    double sum = 0;
    for (float l : raw_) sum += std::exp(static_cast<double>(l - max_raw));
    const float log_normalizer = max_raw + static_cast<float>(std::log(sum));
    out.logprob = raw_[out.token] - log_normalizer;
    const int top_n = std::clamp(*params.logprobs, 0, vocab_size_);
    candidates_.resize(vocab_size_);
    std::iota(candidates_.begin(), candidates_.end(), 0);
    std::partial_sort(candidates_.begin(), candidates_.begin() + top_n, candidates_.end(),
                      [&](int32_t a, int32_t b) {
                        return raw_[a] > raw_[b] || (raw_[a] == raw_[b] && a < b);
                      });
    out.top_logprobs.reserve(top_n);
    for (int i = 0; i < top_n; ++i) {
      out.top_logprobs.push_back({candidates_[i], raw_[candidates_[i]] - log_normalizer});
    }
  }
  return out;
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

int32_t Sampler::Draw(std::span<const float> logits, const SamplingParams& params,
                      double uniform) {
  candidates_.clear();
  for (int32_t t = 0; t < vocab_size_; ++t) {
    if (logits[t] != kNegInf) candidates_.push_back(t);
  }
  if (candidates_.empty()) return ArgMax(logits);  // everything banned: nothing sensible left
  const float max_logit = logits[ArgMax(logits)];
  auto higher = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  // Unnormalized probabilities, computed once.
  for (int32_t t : candidates_) weights_[t] = std::exp(logits[t] - max_logit);
  auto weight = [&](int32_t t) { return static_cast<double>(weights_[t]); };

  // Each filter keeps a head of the candidates in `higher` order (the top token always stays),
  // so they apply one after another to a shrinking count n.
  size_t n = candidates_.size();
  if (params.top_k > 0 && static_cast<size_t>(params.top_k) < n) {
    std::nth_element(candidates_.begin(), candidates_.begin() + params.top_k, candidates_.end(),
                     higher);
    n = params.top_k;
  }
  if (params.top_p < 1.0f) {
    double total = 0;
    for (size_t i = 0; i < n; ++i) total += weight(candidates_[i]);
    n = TopPCount(candidates_, n, params.top_p * total, higher, weight);
  }
  if (params.min_p > 0.0f) {
    // p / p_max >= min_p, and the ratio does not depend on the normalization.
    const float threshold = max_logit + std::log(params.min_p);
    auto end = std::stable_partition(candidates_.begin(), candidates_.begin() + n,
                                     [&](int32_t t) { return logits[t] >= threshold; });
    n = end - candidates_.begin();
  }

  double total = 0;
  for (size_t i = 0; i < n; ++i) total += weight(candidates_[i]);
  const double target = uniform * total;
  double cumulative = 0;
  for (size_t i = 0; i < n; ++i) {
    cumulative += weight(candidates_[i]);
    if (target < cumulative) return candidates_[i];
  }
  return candidates_[n - 1];  // rounding at the top end
}

}  // namespace exl3::engine
