// The KV cache's storage on the CPU: for every layer, num_blocks blocks of block_size token slots,
// a slot of that layer's width in floats (engine/model_config.h's KvWidth: layers of one model
// may differ, e.g. GLM-MoE-DSA's indexer keys live only in layers that run an indexer),
// allocated once. Which block holds which positions of a sequence is the scheduler's business (its
// block table); this class only finds a slot from a block table and a position.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/model_runner.h"

namespace exl3::engine {

class PagedKvCache {
 public:
  // widths[l]: floats of one token's slot in layer l.
  PagedKvCache(std::vector<int> widths, const KvCacheShape& shape)
      : widths_(std::move(widths)), shape_(shape) {
    const size_t slots = static_cast<size_t>(shape.num_blocks) * shape.block_size;
    size_t offset = 0;
    for (int w : widths_) {
      layer_offset_.push_back(offset);
      offset += slots * w;
    }
    data_.resize(offset);
  }

  int width(int layer) const { return widths_[layer]; }
  const KvCacheShape& shape() const { return shape_; }
  // The slot of `position` in a sequence whose blocks are `block_table`.
  float* Slot(int layer, const std::vector<int32_t>& block_table, int position) {
    const int32_t block = block_table[position / shape_.block_size];
    const size_t slot = static_cast<size_t>(block) * shape_.block_size + position % shape_.block_size;
    return data_.data() + layer_offset_[layer] + slot * widths_[layer];
  }

 private:
  std::vector<int> widths_;
  KvCacheShape shape_;
  std::vector<size_t> layer_offset_;  // first float of each layer
  std::vector<float> data_;
};

}  // namespace exl3::engine
