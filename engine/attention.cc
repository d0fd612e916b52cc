#include "engine/attention.h"

#include <algorithm>
#include <cmath>

#include "engine/dsa_attention.h"
#include "engine/dsv4_attention.h"
#include "engine/gqa_attention.h"
#include "engine/mla_attention.h"
#include "engine/qsa_attention.h"

namespace exl3::engine {

absl::StatusOr<std::unique_ptr<Attention>> LoadAttention(const ModelConfig& cfg,
                                                         const TensorSource& src, int layer) {
  if (cfg.attention == AttentionKind::kDsv4) {
    auto a = Dsv4Attention::Load(cfg, src, layer);
    if (!a.ok()) return a.status();
    return std::unique_ptr<Attention>(std::move(*a));
  }
  if (cfg.attention == AttentionKind::kQsa) {
    auto a = QsaAttention::Load(cfg, src, layer);
    if (!a.ok()) return a.status();
    return std::unique_ptr<Attention>(std::move(*a));
  }
  if (cfg.attention == AttentionKind::kDsa) {
    auto a = DsaAttention::Load(cfg, src, layer);
    if (!a.ok()) return a.status();
    return std::unique_ptr<Attention>(std::move(*a));
  }
  if (cfg.attention == AttentionKind::kMla) {
    auto a = MlaAttention::Load(cfg, src, layer);
    if (!a.ok()) return a.status();
    return std::unique_ptr<Attention>(std::move(*a));
  }
  auto a = GqaAttention::Load(cfg, src, layer);
  if (!a.ok()) return a.status();
  return std::unique_ptr<Attention>(std::move(*a));
}

void SoftmaxInPlace(float* s, int n) {
  const float m = *std::max_element(s, s + n);
  float sum = 0.0f;
  for (int i = 0; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    sum += s[i];
  }
  const float inv = 1.0f / sum;
  for (int i = 0; i < n; ++i) s[i] *= inv;
}

}  // namespace exl3::engine
