#include "engine/cpu/linear_attention/load_linear_attention.h"

#include "engine/cpu/linear_attention/gated_deltanet.h"
#include "engine/cpu/linear_attention/kimi_delta_attention.h"

namespace exl3::engine {

absl::StatusOr<std::unique_ptr<LinearAttention>> LoadLinearAttention(const ModelConfig& cfg,
                                                                     const TensorSource& src, int layer) {
  if (cfg.attention == AttentionKind::kPooledDsa) {
    auto a = KimiDeltaAttention::Load(cfg, src, layer);
    if (!a.ok()) return a.status();
    return std::unique_ptr<LinearAttention>(std::move(*a));
  }
  auto a = GatedDeltaNet::Load(cfg, src, layer);
  if (!a.ok()) return a.status();
  return std::unique_ptr<LinearAttention>(std::move(*a));
}

}  // namespace exl3::engine
