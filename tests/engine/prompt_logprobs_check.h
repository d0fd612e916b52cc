// The check the prompt-logprobs tests share (tests/engine/prompt_logprobs_test.cc on the CPU engine,
// tests/engine/cuda/prompt_logprobs_test.cc on the GPU engine): a request's prompt logprobs against
// the log_softmax of a fixture's reference logits at the position before each prompt token.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

#include "engine/sampling/sampler.h"
#include "gtest/gtest.h"

namespace exl3::engine::testing {

// `logits` holds the reference rows [positions, vocab] (row p predicts token p + 1); `bound(row)`
// is how far a logprob of that row may be from the reference's. Checks every prompt token's
// logprob and the top `top_n`; returns the worst absolute logprob error.
inline double CheckPromptLogprobs(const std::vector<int32_t>& prompt, const std::vector<float>& logits, int vocab,
                                  const std::vector<SampledToken>& got, int top_n,
                                  const std::function<double(const float* row)>& bound) {
  EXPECT_EQ(got.size(), prompt.size() - 1);
  double worst = 0;
  for (size_t p = 0; p + 1 < prompt.size() && p < got.size(); ++p) {
    const float* row = &logits[p * vocab];
    const double max_logit = *std::max_element(row, row + vocab);
    double sum = 0;
    for (int t = 0; t < vocab; ++t) sum += std::exp(row[t] - max_logit);
    const double log_z = max_logit + std::log(sum);
    const double allowed = bound(row);
    EXPECT_EQ(got[p].token, prompt[p + 1]) << "position " << p;
    EXPECT_TRUE(got[p].logprob.has_value());
    if (!got[p].logprob.has_value()) continue;
    const double err = std::fabs(*got[p].logprob - (row[prompt[p + 1]] - log_z));
    EXPECT_LT(err, allowed) << "position " << p;
    worst = std::max(worst, err);
    // The top N: the reference's best N logits (ties aside), in order.
    EXPECT_EQ(got[p].top_logprobs.size(), static_cast<size_t>(top_n));
    std::vector<float> sorted(row, row + vocab);
    std::partial_sort(sorted.begin(), sorted.begin() + top_n, sorted.end(), std::greater<float>());
    for (int k = 0; k < top_n && k < static_cast<int>(got[p].top_logprobs.size()); ++k)
      EXPECT_LT(std::fabs(got[p].top_logprobs[k].logprob - (sorted[k] - log_z)), allowed)
          << "position " << p << " top " << k;
  }
  return worst;
}

}  // namespace exl3::engine::testing
