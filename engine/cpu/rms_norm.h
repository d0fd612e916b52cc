// RMSNorm as the engine's families define it: y = x / sqrt(mean(x²) + eps) * w, in fp32 (the mean
// accumulated in double).
#pragma once

#include <cmath>

namespace exl3::engine {

inline void RmsNorm(const float* x, const float* w, int n, float eps, float* y) {
  double ss = 0.0;
  for (int i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = static_cast<float>(1.0 / std::sqrt(ss / n + eps));
  for (int i = 0; i < n; ++i) y[i] = w[i] * (x[i] * inv);
}

// x ← x / sqrt(Σx² + 1e-6), transformers' l2norm of linear attention's q and k (gated DeltaNet,
// KDA), the sum in double.
inline void L2NormalizeInPlace(float* x, int n) {
  double ss = 0.0;
  for (int i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = static_cast<float>(1.0 / std::sqrt(ss + 1e-6));
  for (int i = 0; i < n; ++i) x[i] *= inv;
}

// Each of `rows` rows of n values: x [rows, n] -> y [rows, n] (y may be x).
inline void RmsNormRows(const float* x, const float* w, int rows, int n, float eps, float* y) {
  for (int r = 0; r < rows; ++r) RmsNorm(x + static_cast<size_t>(r) * n, w, n, eps, y + static_cast<size_t>(r) * n);
}

}  // namespace exl3::engine
