#include "engine/cpu/attention/kpool_indexer.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace exl3::engine {

std::vector<float> KpoolKeys(const float* keys, const float* gates, int num_positions,
                             const float* ape, const KpoolShape& s) {
  const int P = s.pool, D = s.head_dim, pools = num_positions / P;
  std::vector<float> out(static_cast<size_t>(pools) * D, 0.0f);
  std::vector<float> logit(P);
  for (int p = 0; p < pools; ++p) {
    for (int c = 0; c < D; ++c) {
      float mx = -INFINITY;
      for (int j = 0; j < P; ++j) {
        logit[j] = gates[static_cast<size_t>(p * P + j) * D + c] + ape[j * D + c];
        mx = std::max(mx, logit[j]);
      }
      float sum = 0.0f, acc = 0.0f;
      for (int j = 0; j < P; ++j) {
        logit[j] = std::exp(logit[j] - mx);
        sum += logit[j];
      }
      for (int j = 0; j < P; ++j) acc += logit[j] / sum * keys[static_cast<size_t>(p * P + j) * D + c];
      out[static_cast<size_t>(p) * D + c] = acc;
    }
  }
  return out;
}

std::vector<int32_t> SelectPooledPositions(const float* q, const float* w, const float* pool_keys,
                                           int position, const KpoolShape& s) {
  const int P = s.pool, D = s.head_dim;
  const int visible = (position + 1) / P;  // complete pools ending at or before `position`
  std::vector<int32_t> pools(visible);
  std::iota(pools.begin(), pools.end(), 0);
  if (visible > s.select_pools) {
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    std::vector<float> score(visible, 0.0f);
    for (int p = 0; p < visible; ++p) {
      const float* key = pool_keys + static_cast<size_t>(p) * D;
      for (int h = 0; h < s.num_heads; ++h) {
        const float* qh = q + static_cast<size_t>(h) * D;
        float dot = 0.0f;
        for (int c = 0; c < D; ++c) dot += qh[c] * key[c];
        score[p] += w[h] * std::max(dot * scale, 0.0f);
      }
    }
    std::partial_sort(pools.begin(), pools.begin() + s.select_pools, pools.end(), [&](int32_t a, int32_t b) {
      return score[a] != score[b] ? score[a] > score[b] : a < b;
    });
    pools.resize(s.select_pools);
    std::sort(pools.begin(), pools.end());
  }
  std::vector<int32_t> positions;
  positions.reserve(static_cast<size_t>(pools.size()) * P + P);
  for (int32_t p : pools)
    for (int j = 0; j < P; ++j) positions.push_back(p * P + j);
  for (int t = visible * P; t <= position; ++t) positions.push_back(t);  // the tail
  return positions;
}

}  // namespace exl3::engine
