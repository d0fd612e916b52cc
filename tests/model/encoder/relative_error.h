// Test helper: how far an EXL3 layer's dequantized weight is from the original.
#pragma once

#include <cstddef>
#include <vector>

#include "kernels/exl3_linear.h"

namespace exl3::testing {

// ‖W − Ŵ‖² / ‖W‖²: `v` dequantized (DequantizeDense, [in, out]) against `w_hf` ([out, in], the
// Hugging Face orientation).
inline double DequantRelativeError(const Exl3LinearView& v, const std::vector<float>& w_hf) {
  const int in = v.in_features, out = v.out_features;
  std::vector<float> dense(static_cast<size_t>(in) * out);
  DequantizeDense(v, dense.data());
  double num = 0, den = 0;
  for (int o = 0; o < out; ++o)
    for (int i = 0; i < in; ++i) {
      const double ref = w_hf[static_cast<size_t>(o) * in + i];
      const double d = dense[static_cast<size_t>(i) * out + o] - ref;
      num += d * d;
      den += ref * ref;
    }
  return num / den;
}

}  // namespace exl3::testing
