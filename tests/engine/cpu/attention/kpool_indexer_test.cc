// engine/cpu/attention/kpool_indexer: the k-pooled selection against a straightforward implementation (double
// pool keys and scores, a full sort) on fresh random inputs, for every position of a sequence:
// before the first complete pool (tail only), while every complete pool fits the budget, at pool
// edges ((t + 1) a multiple of P: no tail) and past the budget.
#include "engine/cpu/attention/kpool_indexer.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace exl3::engine {
namespace {

std::vector<int32_t> Straightforward(const std::vector<float>& q, const std::vector<float>& w,
                                     const std::vector<float>& keys, const std::vector<float>& gates,
                                     const std::vector<float>& ape, int t, const KpoolShape& s) {
  const int P = s.pool, D = s.head_dim;
  std::vector<std::pair<double, int>> scored;  // (−score, pool): sorting ascending ranks them
  for (int p = 0; (p + 1) * P - 1 <= t; ++p) {
    std::vector<double> key(D, 0.0);
    for (int c = 0; c < D; ++c) {
      double sum = 0.0;
      for (int j = 0; j < P; ++j) sum += std::exp(gates[(p * P + j) * D + c] + ape[j * D + c]);
      for (int j = 0; j < P; ++j)
        key[c] += std::exp(gates[(p * P + j) * D + c] + ape[j * D + c]) / sum * keys[(p * P + j) * D + c];
    }
    double score = 0.0;
    for (int h = 0; h < s.num_heads; ++h) {
      double dot = 0.0;
      for (int c = 0; c < D; ++c) dot += q[h * D + c] * key[c];
      score += w[h] * std::max(dot / std::sqrt(static_cast<double>(D)), 0.0);
    }
    scored.push_back({-score, p});
  }
  std::sort(scored.begin(), scored.end());
  std::vector<int32_t> positions;
  for (size_t i = 0; i < scored.size() && static_cast<int>(i) < s.select_pools; ++i)
    for (int j = 0; j < P; ++j) positions.push_back(scored[i].second * P + j);
  for (int u = (t + 1) / P * P; u <= t; ++u) positions.push_back(u);
  std::sort(positions.begin(), positions.end());
  return positions;
}

TEST(KpoolIndexer, MatchesAStraightforwardSelectionAtEveryPosition) {
  for (uint32_t seed : {1u, 2u, 3u}) {
    const KpoolShape s{/*num_heads=*/4, /*head_dim=*/16, /*pool=*/4, /*select_pools=*/3};
    const int N = 53;  // 13 complete pools and a tail of 1
    std::mt19937 rng(seed);
    std::normal_distribution<float> n(0.0f, 1.0f);
    auto draw = [&](size_t count) {
      std::vector<float> x(count);
      for (float& v : x) v = n(rng);
      return x;
    };
    const std::vector<float> keys = draw(N * s.head_dim), gates = draw(N * s.head_dim),
                             ape = draw(s.pool * s.head_dim);
    const std::vector<float> pool_keys = KpoolKeys(keys.data(), gates.data(), N, ape.data(), s);
    ASSERT_EQ(pool_keys.size(), static_cast<size_t>(N / s.pool * s.head_dim));
    for (int t = 0; t < N; ++t) {
      const std::vector<float> q = draw(s.num_heads * s.head_dim), w = draw(s.num_heads);
      const std::vector<int32_t> got = SelectPooledPositions(q.data(), w.data(), pool_keys.data(), t, s);
      EXPECT_EQ(got, Straightforward(q, w, keys, gates, ape, t, s)) << "seed " << seed << " position " << t;
      // Every position is visible and the query's own tail is always there.
      for (int32_t p : got) EXPECT_LE(p, t);
      const int tail = (t + 1) % s.pool;
      for (int u = t - tail + 1; u <= t; ++u)
        EXPECT_NE(std::find(got.begin(), got.end(), u), got.end()) << t;
      const int visible = (t + 1) / s.pool;
      EXPECT_EQ(static_cast<int>(got.size()), std::min(visible, s.select_pools) * s.pool + tail) << t;
    }
  }
}

TEST(KpoolIndexer, PoolOfOneIsPerPositionSelection) {
  const KpoolShape s{2, 8, 1, 2};
  std::mt19937 rng(5);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> keys(10 * 8), gates(10 * 8), ape(8), q(16), w(2);
  for (auto* v : {&keys, &gates, &ape, &q, &w})
    for (float& x : *v) x = n(rng);
  const std::vector<float> pool_keys = KpoolKeys(keys.data(), gates.data(), 10, ape.data(), s);
  // With P = 1 a pool's key is its position's key.
  for (size_t i = 0; i < pool_keys.size(); ++i) EXPECT_NEAR(pool_keys[i], keys[i], 1e-6);
  EXPECT_EQ(SelectPooledPositions(q.data(), w.data(), pool_keys.data(), 9, s),
            Straightforward(q, w, keys, gates, ape, 9, s));
}

}  // namespace
}  // namespace exl3::engine
