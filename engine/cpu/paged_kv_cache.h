// The KV cache's storage on the CPU: for every layer, num_blocks blocks of block_size token slots
// plus, where the layer keeps per-block state, one block area; allocated once. A slot has its
// layer's token width in floats (engine/config/model_config.h's KvWidth: layers of one model may differ,
// e.g. GLM-MoE-DSA's indexer keys live only in layers that run an indexer); a block area has the
// layer's block width (KvBlockFloats: DeepSeek-V4's compressed layers keep their compressor's
// running state and the compressed entries of the windows that close in the block there,
// engine/config/dsv4_config.h). Which block holds which positions of a sequence is the scheduler's
// business (its block table); this class only finds a slot or a block area from a block table
// and a position.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/core/model_runner.h"

namespace exl3::engine {

// Floats one layer keeps per token slot and per block.
struct KvLayerShape {
  int token_floats = 0;
  int block_floats = 0;
};

class PagedKvCache {
 public:
  PagedKvCache(std::vector<KvLayerShape> layers, const KvCacheShape& shape)
      : layers_(std::move(layers)), shape_(shape) {
    size_t offset = 0;
    for (const KvLayerShape& l : layers_) {
      layer_offset_.push_back(offset);
      offset += static_cast<size_t>(shape.num_blocks) * BlockStride(l);
    }
    data_.resize(offset);
  }

  int width(int layer) const { return layers_[layer].token_floats; }
  int block_width(int layer) const { return layers_[layer].block_floats; }
  const KvCacheShape& shape() const { return shape_; }
  // The slot of `position` in a sequence whose blocks are `block_table`.
  float* Slot(int layer, const std::vector<int32_t>& block_table, int position) {
    return BlockStart(layer, block_table, position) +
           static_cast<size_t>(position % shape_.block_size) * layers_[layer].token_floats;
  }
  // The block area of the block holding `position`.
  float* BlockArea(int layer, const std::vector<int32_t>& block_table, int position) {
    return BlockStart(layer, block_table, position) +
           static_cast<size_t>(shape_.block_size) * layers_[layer].token_floats;
  }

 private:
  size_t BlockStride(const KvLayerShape& l) const {
    return static_cast<size_t>(shape_.block_size) * l.token_floats + l.block_floats;
  }
  float* BlockStart(int layer, const std::vector<int32_t>& block_table, int position) {
    const int32_t block = block_table[position / shape_.block_size];
    return data_.data() + layer_offset_[layer] + static_cast<size_t>(block) * BlockStride(layers_[layer]);
  }

  std::vector<KvLayerShape> layers_;
  KvCacheShape shape_;
  std::vector<size_t> layer_offset_;  // first float of each layer
  std::vector<float> data_;
};

}  // namespace exl3::engine
