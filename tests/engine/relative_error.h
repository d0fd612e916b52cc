// ‖a − ref‖ / ‖ref‖ in double, the engine tests' measure of how far logits or activations are
// from their reference.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

namespace exl3::engine::testing {

inline double RelativeError(const float* a, const float* ref, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num += (static_cast<double>(a[i]) - ref[i]) * (static_cast<double>(a[i]) - ref[i]);
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

inline double RelativeError(const std::vector<float>& a, const std::vector<float>& ref) {
  return RelativeError(a.data(), ref.data(), ref.size());
}

}  // namespace exl3::engine::testing
