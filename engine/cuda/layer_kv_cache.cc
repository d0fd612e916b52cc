#include "engine/cuda/layer_kv_cache.h"

#include <algorithm>

namespace exl3::engine::cuda {

absl::Status LayerKvCache::Allocate(const ModelConfig& cfg, const KvCacheShape& shape) {
  const size_t slots = static_cast<size_t>(shape.num_blocks + 1) * shape.block_size;
  offset_.assign(cfg.num_layers, 0);
  size_t total = 0;
  for (int l : layers_) {
    offset_[l] = total;
    total += slots * cfg.KvWidth(l);
  }
  max_context_ = static_cast<int>(std::min<int64_t>(cfg.max_position_embeddings,
                                                    static_cast<int64_t>(shape.num_blocks) * shape.block_size));
  data_ = DeviceArray<KvHalf>();
  return data_.Reserve(total);
}

int64_t LayerKvCache::BytesPerToken(const ModelConfig& cfg) const {
  int64_t halves = 0;
  for (int l : layers_) halves += cfg.KvWidth(l);
  return halves * static_cast<int64_t>(sizeof(KvHalf));
}

}  // namespace exl3::engine::cuda
