#include "engine/cpu/rope.h"

#include <algorithm>
#include <cmath>

namespace exl3::engine {
namespace {

constexpr double kPi = 3.14159265358979323846;

std::vector<float> BaseFrequencies(double base, int dim) {
  std::vector<float> f(dim / 2);
  for (int i = 0; i < dim / 2; ++i)
    f[i] = static_cast<float>(1.0 / std::pow(base, static_cast<double>(2 * i) / dim));
  return f;
}

// YaRN: blend of extrapolated (original) and interpolated (divided by factor) frequencies over
// a linear ramp between the correction dimensions of beta_fast and beta_slow rotations.
std::vector<float> YarnFrequencies(const RopeConfig& c) {
  const int dim = c.rotary_dim;
  auto correction_dim = [&](double rotations) {
    return dim * std::log(c.original_max_position / (rotations * 2 * kPi)) / (2 * std::log(c.theta));
  };
  double low = correction_dim(c.beta_fast), high = correction_dim(c.beta_slow);
  if (c.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;
  std::vector<float> f(dim / 2);
  for (int i = 0; i < dim / 2; ++i) {
    const float pos_freq = static_cast<float>(std::pow(c.theta, static_cast<double>(2 * i) / dim));
    const float extrapolation = 1.0f / pos_freq;
    const float interpolation = 1.0f / (static_cast<float>(c.factor) * pos_freq);
    const float ramp = std::clamp(static_cast<float>((i - low) / (high - low)), 0.0f, 1.0f);
    const float extrapolation_weight = 1.0f - ramp;
    f[i] = interpolation * (1.0f - extrapolation_weight) + extrapolation * extrapolation_weight;
  }
  return f;
}

}  // namespace

std::vector<float> RopeInverseFrequencies(const RopeConfig& c, int max_position, int seq_len) {
  switch (c.type) {
    case RopeType::kDefault:
      return BaseFrequencies(c.theta, c.rotary_dim);
    case RopeType::kLinear: {
      std::vector<float> f = BaseFrequencies(c.theta, c.rotary_dim);
      for (float& v : f) v /= static_cast<float>(c.factor);
      return f;
    }
    case RopeType::kDynamic: {
      const double len = std::max(seq_len, max_position);
      const int dim = c.rotary_dim;
      const double base =
          c.theta * std::pow(c.factor * len / max_position - (c.factor - 1), dim / (dim - 2.0));
      return BaseFrequencies(base, dim);
    }
    case RopeType::kYarn:
      return YarnFrequencies(c);
  }
  return {};
}

Rope::Rope(const RopeConfig& cfg, int max_position_embeddings)
    : cfg_(cfg),
      max_position_(max_position_embeddings),
      inv_freq_(RopeInverseFrequencies(cfg, max_position_embeddings, max_position_embeddings)) {}

void Rope::Angles(int position, int seq_len, RopeAngles* out) const {
  std::vector<float> dynamic;
  if (cfg_.type == RopeType::kDynamic && seq_len > max_position_)
    dynamic = RopeInverseFrequencies(cfg_, max_position_, seq_len);
  const std::vector<float>& inv_freq = dynamic.empty() ? inv_freq_ : dynamic;
  const int half = cfg_.rotary_dim / 2;
  const float scale = static_cast<float>(cfg_.attention_factor);
  out->cos.resize(half);
  out->sin.resize(half);
  out->scratch.resize(cfg_.rotary_dim);
  for (int i = 0; i < half; ++i) {
    const float angle = static_cast<float>(position) * inv_freq[i];
    out->cos[i] = static_cast<float>(std::cos(static_cast<double>(angle))) * scale;
    out->sin[i] = static_cast<float>(std::sin(static_cast<double>(angle))) * scale;
  }
}

void Rope::Apply(RopeAngles& angles, float* x, int num_heads, int head_stride) const {
  const int half = cfg_.rotary_dim / 2;
  const float* cs = angles.cos.data();
  const float* sn = angles.sin.data();
  float* t = angles.scratch.data();
  for (int h = 0; h < num_heads; ++h) {
    float* v = x + static_cast<size_t>(h) * head_stride;
    if (cfg_.layout == RopeLayout::kHalfSplit) {
      for (int i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * cs[i] - b * sn[i];
        v[i + half] = b * cs[i] + a * sn[i];
      }
    } else {
      for (int i = 0; i < half; ++i) {
        const float a = v[2 * i], b = v[2 * i + 1];
        t[i] = a * cs[i] - b * sn[i];
        t[i + half] = b * cs[i] + a * sn[i];
      }
      std::copy(t, t + cfg_.rotary_dim, v);
    }
  }
}

void Rope::Apply(float* x, int num_heads, int head_stride, int position, int seq_len) const {
  RopeAngles angles;
  Angles(position, seq_len, &angles);
  Apply(angles, x, num_heads, head_stride);
}

}  // namespace exl3::engine
