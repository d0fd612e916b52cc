#include "engine/cpu/mtp/mtp_drafter.h"

namespace exl3::engine {

ModelConfig WithMtpLayer(const ModelConfig& cfg, bool moe) {
  ModelConfig c = cfg;
  const int n = cfg.num_layers;
  c.num_layers = n + 1;
  c.layer_mixers.resize(n + 1, TokenMixer::kAttention);
  c.layer_mixers[n] = TokenMixer::kAttention;
  if (c.attention == AttentionKind::kDsa || c.attention == AttentionKind::kPooledDsa) {
    c.indexer.layer_modes.resize(n + 1, IndexerMode::kFull);
    c.indexer.layer_modes[n] = IndexerMode::kFull;
  }
  c.moe.num_hidden_layers = n + 1;
  c.moe.moe_layers.resize(n + 1, false);
  c.moe.moe_layers[n] = moe;
  c.moe.hash_routed_layers.resize(n + 1, false);
  return c;
}

}  // namespace exl3::engine
