#include "engine/cuda/cuda_mixer.h"

namespace exl3::engine::cuda {

SplitShape CudaMixers::split_shape() const {
  for (const auto& kind : kinds)
    if (kind->split_shape().blocks_per_token > 0) return kind->split_shape();
  return SplitShape{1};
}

bool CudaMixers::graph_capturable() const {
  for (const auto& kind : kinds)
    if (!kind->graph_capturable()) return false;
  return true;
}

const RecurrentLayerStates* CudaMixers::recurrent_states() const {
  for (const auto& kind : kinds)
    if (kind->recurrent_states() != nullptr) return kind->recurrent_states();
  return nullptr;
}

bool CudaMixers::rows_split() const {
  for (const auto& kind : kinds)
    if (!kind->rows_split()) return false;
  return true;
}

}  // namespace exl3::engine::cuda
