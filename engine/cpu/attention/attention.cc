#include "engine/cpu/attention/attention.h"

#include <algorithm>
#include <cmath>

namespace exl3::engine {

void SoftmaxInPlace(float* s, int n) {
  const float m = *std::max_element(s, s + n);
  float sum = 0.0f;
  for (int i = 0; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    sum += s[i];
  }
  const float inv = 1.0f / sum;
  for (int i = 0; i < n; ++i) s[i] *= inv;
}

}  // namespace exl3::engine
