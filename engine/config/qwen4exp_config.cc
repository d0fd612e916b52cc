#include "engine/config/qwen4exp_config.h"

#include <algorithm>

namespace exl3::engine {

int PleConfig::PleIndex(int layer) const {
  auto it = std::find(layers.begin(), layers.end(), layer);
  return it == layers.end() ? -1 : static_cast<int>(it - layers.begin());
}

}  // namespace exl3::engine
