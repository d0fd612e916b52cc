// The fp16 KV cache of one mixer kind's layers (engine/cuda/cuda_mixer.h): one device allocation,
// each of the kind's layers num_blocks + 1 blocks of block_size slots (the spare block takes decode
// graphs' padding rows), KvWidth(layer) halves per slot in the CPU engine's slot layout.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "engine/cuda/attention_kernels.h"
#include "engine/cuda/device_array.h"
#include "engine/config/model_config.h"
#include "engine/core/model_runner.h"

namespace exl3::engine::cuda {

class LayerKvCache {
 public:
  void AddLayer(int layer) { layers_.push_back(layer); }
  // Drops the old cache, then allocates one for `shape`.
  absl::Status Allocate(const ModelConfig& cfg, const KvCacheShape& shape);
  KvHalf* layer(int l) const { return data_.get() + offset_[l]; }
  int64_t BytesPerToken(const ModelConfig& cfg) const;
  // The positions a sequence can reach in the cache (the model's limit, or the cache's).
  int max_context() const { return max_context_; }

 private:
  std::vector<int> layers_;
  std::vector<size_t> offset_;  // by model layer; only the kind's layers' used
  int max_context_ = 0;
  DeviceArray<KvHalf> data_;
};

}  // namespace exl3::engine::cuda
