// Test helper: random EXL3 linear layers and expert MLPs held in memory (random trellis bits,
// random +-1 suh/svh with random magnitudes, optional bias).
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "kernels/exl3_linear.h"
#include "kernels/fp16.h"
#include "kernels/moe_cpu.h"

namespace exl3::testing {

struct RandomLinear {
  std::vector<uint16_t> trellis, suh, svh, bias;
  Exl3LinearView view;

  RandomLinear(int k, int n, int K, Codebook cb, uint32_t seed, bool with_bias = false) {
    std::mt19937 rng(seed);
    view.in_features = k;
    view.out_features = n;
    view.bits = K;
    view.codebook = cb;
    trellis.resize(view.trellis_words());
    for (auto& w : trellis) w = static_cast<uint16_t>(rng());
    std::uniform_real_distribution<float> mag(0.5f, 1.5f);
    // Scale so that outputs stay O(1): |W| entries ~ 1.2 * |suh| * |svh|.
    const float s = 1.0f / std::sqrt(static_cast<float>(k));
    for (int i = 0; i < k; ++i) suh.push_back(FloatToHalfBits((rng() & 1 ? -1.f : 1.f) * mag(rng) * s));
    for (int i = 0; i < n; ++i) svh.push_back(FloatToHalfBits((rng() & 1 ? -1.f : 1.f) * mag(rng)));
    view.trellis = trellis.data();
    view.suh = suh.data();
    view.svh = svh.data();
    if (with_bias) {
      std::normal_distribution<float> nd(0.f, 0.1f);
      for (int i = 0; i < n; ++i) bias.push_back(FloatToHalfBits(nd(rng)));
      view.bias = bias.data();
    }
  }
};

struct RandomExpert {
  std::unique_ptr<RandomLinear> gate, up, down;
  ExpertMlp mlp;
  RandomExpert(int hidden, int inter, uint32_t seed, int K = 2, Codebook cb = Codebook::kMcg) {
    gate = std::make_unique<RandomLinear>(hidden, inter, K, cb, seed * 3 + 1);
    up = std::make_unique<RandomLinear>(hidden, inter, K == 8 ? 8 : K + 1, Codebook::k3Inst, seed * 3 + 2);
    down = std::make_unique<RandomLinear>(inter, hidden, K, Codebook::kMul1, seed * 3 + 3);
    mlp.gate = gate->view;
    mlp.up = up->view;
    mlp.down = down->view;
  }
};

inline std::vector<float> RandomVector(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

inline double RelErr(const float* out, const float* ref, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num += (double(out[i]) - ref[i]) * (double(out[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

}  // namespace exl3::testing
