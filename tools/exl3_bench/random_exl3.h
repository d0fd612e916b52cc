// Random EXL3 layers for the CUDA check and bench tools: random trellis bits, random ±1 suh/svh
// times random magnitudes (scaled so outputs stay O(1)), optional bias; never zeros.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/exl3_linear.h"
#include "kernels/fp16.h"
#include "kernels/moe_cpu.h"

namespace exl3::benchutil {

struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 0x1234567ull) {}
  uint64_t Next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  float Uniform() { return (Next() >> 40) * (1.0f / 16777216.0f); }  // [0, 1)
  float Normal() {
    const float u1 = std::max(Uniform(), 1e-7f), u2 = Uniform();
    return std::sqrt(-2.f * std::log(u1)) * std::cos(6.2831853f * u2);
  }
};

struct RandomLinear {
  std::vector<uint16_t> trellis, suh, svh, bias;
  Exl3LinearView view;
  RandomLinear(int k, int n, int K, Codebook cb, uint64_t seed, bool with_bias = false) {
    Rng rng(seed);
    view.in_features = k;
    view.out_features = n;
    view.bits = K;
    view.codebook = cb;
    trellis.resize(view.trellis_words());
    for (size_t i = 0; i < trellis.size(); i += 4) {
      const uint64_t r = rng.Next();
      for (size_t j = 0; j < 4 && i + j < trellis.size(); ++j) trellis[i + j] = static_cast<uint16_t>(r >> (16 * j));
    }
    const float s = 1.0f / std::sqrt(static_cast<float>(k));
    for (int i = 0; i < k; ++i)
      suh.push_back(FloatToHalfBits((rng.Next() & 1 ? -1.f : 1.f) * (0.5f + rng.Uniform()) * s));
    for (int i = 0; i < n; ++i) svh.push_back(FloatToHalfBits((rng.Next() & 1 ? -1.f : 1.f) * (0.5f + rng.Uniform())));
    view.trellis = trellis.data();
    view.suh = suh.data();
    view.svh = svh.data();
    if (with_bias) {
      for (int i = 0; i < n; ++i) bias.push_back(FloatToHalfBits(0.1f * rng.Normal()));
      view.bias = bias.data();
    }
  }
};

struct ProjSpec {
  int K = 2;
  Codebook cb = Codebook::kMcg;
};

struct RandomExpert {
  std::unique_ptr<RandomLinear> gate, up, down;
  ExpertMlp mlp;
  RandomExpert(int hidden, int inter, uint64_t seed, ProjSpec g, ProjSpec u, ProjSpec d, bool bias = false) {
    gate = std::make_unique<RandomLinear>(hidden, inter, g.K, g.cb, seed * 3 + 1, bias);
    up = std::make_unique<RandomLinear>(hidden, inter, u.K, u.cb, seed * 3 + 2, bias);
    down = std::make_unique<RandomLinear>(inter, hidden, d.K, d.cb, seed * 3 + 3, bias);
    mlp.gate = gate->view;
    mlp.up = up->view;
    mlp.down = down->view;
  }
};

// Per-expert (K, codebook) of the routed experts: expert e's gate is gate[e % gate.size()], and
// so on; an empty list keeps the layer's one spec for that projection.
struct ExpertSpecCycles {
  std::vector<ProjSpec> gate, up, down;
};

// A whole MoE layer with `held` of `num_experts` experts present (the others null).
struct RandomMoeLayer {
  std::vector<std::unique_ptr<RandomExpert>> experts;
  std::unique_ptr<RandomExpert> shared;
  std::vector<float> shared_gate;
  MoeLayerView view;
  RandomMoeLayer(int hidden, int inter, int num_experts, int held_every, ProjSpec g, ProjSpec u, ProjSpec d,
                 int shared_inter, ProjSpec sg, ProjSpec su, ProjSpec sd, float limit, uint64_t seed,
                 bool bias = false, bool with_shared_gate = false, const ExpertSpecCycles& cycles = {}) {
    view.hidden_size = hidden;
    view.intermediate_size = inter;
    view.swiglu_limit = limit;
    view.experts.assign(num_experts, nullptr);
    experts.resize(num_experts);
    for (int e = 0; e < num_experts; ++e) {
      if (held_every > 1 && e % held_every == held_every - 1) continue;  // not held here
      auto pick = [e](const std::vector<ProjSpec>& c, ProjSpec fixed) { return c.empty() ? fixed : c[e % c.size()]; };
      experts[e] = std::make_unique<RandomExpert>(hidden, inter, seed * 1000 + e, pick(cycles.gate, g),
                                                  pick(cycles.up, u), pick(cycles.down, d), bias);
      view.experts[e] = &experts[e]->mlp;
    }
    if (shared_inter > 0) {
      shared = std::make_unique<RandomExpert>(hidden, shared_inter, seed * 1000 + 999, sg, su, sd, bias);
      view.shared = &shared->mlp;
      view.shared_intermediate_size = shared_inter;
      view.shared_swiglu_limit = limit;
      if (with_shared_gate) {
        Rng rng(seed + 77);
        for (int i = 0; i < hidden; ++i) shared_gate.push_back(0.05f * rng.Normal());
        view.shared_gate = shared_gate.data();
      }
    }
  }
};

inline std::vector<float> RandomVector(size_t n, uint64_t seed, float scale = 1.0f) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = scale * rng.Normal();
  return v;
}

inline double RelErr(const float* out, const float* ref, size_t n, bool* bad = nullptr) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(out[i])) {
      if (bad) *bad = true;
      return INFINITY;
    }
    const double d = static_cast<double>(out[i]) - ref[i];
    num += d * d;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

}  // namespace exl3::benchutil
