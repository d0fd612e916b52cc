#include "engine/config/model_config.h"

#include <algorithm>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "engine/config/dsv4_config.h"
#include "engine/config/qwen4exp_config.h"
#include "engine/cpu/sequence_state.h"

namespace exl3::engine {

bool ModelConfig::HasRecurrentLayers() const {
  return std::find(layer_mixers.begin(), layer_mixers.end(), TokenMixer::kLinearAttention) !=
         layer_mixers.end();
}

int64_t ModelConfig::StateFloats(int layer) const {
  if (!IsLinearAttentionLayer(layer)) return 0;
  int64_t n = linear_attention.ConvStateFloats() + linear_attention.RecurrentStateFloats();
  if (qwen4exp != nullptr && qwen4exp->ple.PleIndex(layer) >= 0) n += qwen4exp->PleStateFloats(hidden_size);
  return n;
}

int64_t ModelConfig::StateFloatsPerSequence() const {
  int64_t n = 0;
  for (int l = 0; l < num_layers; ++l) n += StateFloats(l);
  return n;
}

int ModelConfig::KvWidth(int layer) const {
  if (IsLinearAttentionLayer(layer)) return 0;
  // GLM-5.3-Flash: the latent, then on full indexer layers the indexer key and pool gate score.
  if (attention == AttentionKind::kPooledDsa)
    return kv_lora_rank + (HasOwnIndexer(layer) ? 2 * indexer.head_dim : 0);
  if (attention == AttentionKind::kDsv4) return CacheLayoutFor(*dsv4, dsv4->layer_types[layer], 1).token_width;
  if (attention == AttentionKind::kQsa) return 2 * num_kv_heads * head_dim + qwen4exp->indexer.head_dim;
  if (!IsLatentAttention()) return 2 * num_kv_heads * head_dim;
  return kv_lora_rank + qk_rope_head_dim + (HasOwnIndexer(layer) ? indexer.head_dim : 0);
}

int ModelConfig::KvBlockFloats(int layer, int block_size) const {
  if (attention != AttentionKind::kDsv4) return 0;
  return CacheLayoutFor(*dsv4, dsv4->layer_types[layer], block_size).block_width;
}

int64_t ModelConfig::KvFloatsPerToken(int block_size) const {
  int64_t per_block = 0;
  for (int l = 0; l < num_layers; ++l)
    per_block += static_cast<int64_t>(block_size) * KvWidth(l) + KvBlockFloats(l, block_size);
  return (per_block + block_size - 1) / block_size;
}

ModelInfo ModelInfoFor(const ModelConfig& cfg, const std::string& dir, const std::string& served_name) {
  ModelInfo info;
  info.name = served_name.empty() ? std::filesystem::path(dir).lexically_normal().filename().string() : served_name;
  if (info.name.empty()) info.name = std::filesystem::path(dir).parent_path().filename().string();
  info.architecture = cfg.architecture();
  info.vocab_size = cfg.vocab_size;
  info.max_context = cfg.max_position_embeddings;
  info.eos_token_ids = cfg.eos_token_ids;
  info.media_placeholders = cfg.media_placeholders;
  info.kv_bytes_per_token = cfg.KvFloatsPerToken() * static_cast<int64_t>(sizeof(float));
  info.state_bytes_per_sequence = SequenceStateStore::kCopies * cfg.StateFloatsPerSequence() *
                                  static_cast<int64_t>(sizeof(float));
  return info;
}

absl::StatusOr<std::vector<int64_t>> StateFloatsPerLayer(const ModelConfig& cfg, int num_slots) {
  if (num_slots <= 0)
    return absl::InvalidArgumentError(absl::StrCat(
        cfg.architecture(), " keeps a recurrent state per sequence: the cache needs state "
                            "slots (num_sequence_slots ", num_slots, ")"));
  std::vector<int64_t> floats(cfg.num_layers);
  for (int l = 0; l < cfg.num_layers; ++l) floats[l] = cfg.StateFloats(l);
  return floats;
}

}  // namespace exl3::engine
