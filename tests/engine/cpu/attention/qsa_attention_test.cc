// engine/cpu/attention/qsa_attention's block indexer against a straightforward reading of QSA (docs/engine.md,
// "Qwen4-Exp") on fresh random inputs: block scores Σ_h relu(q_h · k_b) / √d, and the selection
// (the block_topk best complete blocks' positions plus the incomplete tail) at every position
// around the block edges, for several block sizes and budgets.
#include "engine/cpu/attention/qsa_attention.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <set>

#include "gtest/gtest.h"

namespace exl3::engine {
namespace {

// The visible positions 0..t as blocks of m; every complete block ranked by score (a higher
// score first, an earlier block on a tie), the best `keep` of them and the tail.
std::vector<int32_t> Reference(const std::vector<double>& scores, int t, int m, int keep) {
  const int complete = (t + 1) / m;
  std::vector<int> order;
  for (int b = 0; b < complete; ++b) order.push_back(b);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return scores[a] > scores[b]; });
  std::set<int32_t> seen;
  for (int i = 0; i < std::min(keep, complete); ++i)
    for (int p = order[i] * m; p < order[i] * m + m; ++p) seen.insert(p);
  for (int p = complete * m; p <= t; ++p) seen.insert(p);  // the incomplete block
  return {seen.begin(), seen.end()};
}

TEST(QsaAttentionTest, BlockScoresAndSelection) {
  std::mt19937 rng(20261206);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  struct Shape { int heads, dim, budget, ratio; };
  const Shape shapes[] = {{8, 32, 8, 4}, {2, 16, 12, 4}, {4, 8, 3, 1}, {3, 24, 9, 3}, {16, 64, 64, 8}};
  int queries = 0, sparse = 0;
  for (const Shape& s : shapes) {
    const QsaIndexerConfig ix{s.heads, s.dim, s.budget, s.ratio};
    const int max_pos = 6 * s.budget + 2 * s.ratio + 1;
    const int blocks = (max_pos + 1) / s.ratio;
    std::vector<float> keys(static_cast<size_t>(blocks) * s.dim);
    for (float& v : keys) v = normal(rng);
    for (int t = 0; t <= max_pos; ++t) {  // every position: block edges included
      std::vector<float> q(static_cast<size_t>(s.heads) * s.dim);
      for (float& v : q) v = normal(rng);
      const int complete = (t + 1) / s.ratio;
      std::vector<float> scores;
      QsaBlockScores(q.data(), keys.data(), complete, ix, &scores);
      ASSERT_EQ(static_cast<int>(scores.size()), complete);
      std::vector<double> want(complete);
      for (int b = 0; b < complete; ++b) {
        double sum = 0.0;
        for (int h = 0; h < s.heads; ++h) {
          double dot = 0.0;
          for (int d = 0; d < s.dim; ++d) dot += static_cast<double>(q[h * s.dim + d]) * keys[b * s.dim + d];
          sum += std::max(dot, 0.0);
        }
        want[b] = sum / std::sqrt(static_cast<double>(s.dim));
        ASSERT_NEAR(scores[b], want[b], 1e-4 * (1.0 + std::fabs(want[b]))) << "block " << b << " at " << t;
      }
      std::vector<double> used(scores.begin(), scores.end());
      const std::vector<int32_t> got = QsaSelectedPositions(scores, t, ix);
      EXPECT_EQ(got, Reference(used, t, s.ratio, ix.block_topk())) << "position " << t;
      // Never more than the budget plus the tail; every position while within the budget.
      EXPECT_LE(static_cast<int>(got.size()), ix.budget + s.ratio - 1);
      if (complete <= ix.block_topk()) {
        EXPECT_EQ(static_cast<int>(got.size()), t + 1) << "position " << t;
      } else {
        ++sparse;
      }
      ++queries;
    }
  }
  EXPECT_GT(sparse, 100);
  EXPECT_GT(queries, 200);
}

// Equal scores: the earlier block wins, as the reference ranks them.
TEST(QsaAttentionTest, TiesGoToTheEarlierBlock) {
  const QsaIndexerConfig ix{1, 4, 8, 4};  // two blocks of four
  const std::vector<float> scores = {0.0f, 1.0f, 0.0f, 1.0f, 0.0f};
  const std::vector<int32_t> got = QsaSelectedPositions(scores, 21, ix);  // 5 blocks, tail 20..21
  const std::vector<int32_t> want = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21};
  EXPECT_EQ(got, want);
}

}  // namespace
}  // namespace exl3::engine
