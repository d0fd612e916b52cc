// The KV cache's storage on the CPU: for every layer, num_blocks blocks of block_size token slots
// of `width` floats each (engine/model_config.h's KvWidth), allocated once. Which block holds
// which positions of a sequence is the scheduler's business (its block table); this class only
// finds a slot from a block table and a position.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/model_runner.h"

namespace exl3::engine {

class PagedKvCache {
 public:
  PagedKvCache(int num_layers, int width, const KvCacheShape& shape)
      : width_(width),
        shape_(shape),
        layer_floats_(static_cast<size_t>(shape.num_blocks) * shape.block_size * width),
        data_(layer_floats_ * num_layers) {}

  int width() const { return width_; }
  const KvCacheShape& shape() const { return shape_; }
  // The slot of `position` in a sequence whose blocks are `block_table`.
  float* Slot(int layer, const std::vector<int32_t>& block_table, int position) {
    const int32_t block = block_table[position / shape_.block_size];
    const size_t slot = static_cast<size_t>(block) * shape_.block_size + position % shape_.block_size;
    return data_.data() + layer * layer_floats_ + slot * width_;
  }

 private:
  int width_;
  KvCacheShape shape_;
  size_t layer_floats_;
  std::vector<float> data_;
};

}  // namespace exl3::engine
