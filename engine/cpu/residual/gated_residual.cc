#include "engine/cpu/residual/gated_residual.h"

#include <cmath>

#include "base/status_macros.h"
#include "engine/config/model_config.h"
#include "engine/cpu/rms_norm.h"

namespace exl3::engine {
namespace {

float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

}  // namespace

absl::StatusOr<GatedResidual> GatedResidual::Load(const TensorSource& src, const std::string& prefix,
                                                  const GatedResidualShape& shape, bool with_inject) {
  GatedResidual g;
  g.shape_ = shape;
  const int wide = shape.streams * shape.hidden;
  EXL3_ASSIGN_OR_RETURN(g.norm_weight_, LoadNormWeight(src, prefix + "hc_norm.weight", wide,
                                                       NormWeightConvention::kOffsetFromOne));
  EXL3_ASSIGN_OR_RETURN(g.down_, Linear::Load(src, prefix + "input_mix_weight_down", wide, shape.lowrank));
  EXL3_ASSIGN_OR_RETURN(g.up_, Linear::Load(src, prefix + "input_mix_weight_up", shape.lowrank, wide));
  if (with_inject) {
    EXL3_ASSIGN_OR_RETURN(Linear inject, Linear::Load(src, prefix + "block_inject_weight", wide, shape.streams));
    g.inject_ = std::move(inject);
  }
  return g;
}

absl::Status GatedResidual::Collapse(const float* h, int T, float* x, std::vector<float>* inject,
                                     CpuCompute& compute) const {
  const int S = shape_.streams, H = shape_.hidden, wide = S * H;
  const float inv_streams = 1.0f / static_cast<float>(S);
  std::vector<float> normed(static_cast<size_t>(T) * wide);
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < S; ++k) {
      const size_t off = static_cast<size_t>(t) * wide + static_cast<size_t>(k) * H;
      RmsNorm(h + off, norm_weight_.data() + static_cast<size_t>(k) * H, H, shape_.eps, normed.data() + off);
    }
  std::vector<float> low(static_cast<size_t>(T) * shape_.lowrank), w(normed.size());
  EXL3_RETURN_IF_ERROR(down_.Forward(normed.data(), T, low.data(), compute));
  for (float& v : low) {
    v *= inv_streams;
    v = v * Sigmoid(v);  // silu
  }
  EXL3_RETURN_IF_ERROR(up_.Forward(low.data(), T, w.data(), compute));
  for (int t = 0; t < T; ++t) {
    float* xt = x + static_cast<size_t>(t) * H;
    const float* wt = w.data() + static_cast<size_t>(t) * wide;
    const float* nt = normed.data() + static_cast<size_t>(t) * wide;
    for (int i = 0; i < H; ++i) {
      float acc = 0.0f;
      for (int k = 0; k < S; ++k) acc += Sigmoid(wt[k * H + i]) * nt[k * H + i];
      xt[i] = acc * inv_streams;
    }
  }
  if (inject_.has_value()) {
    inject->resize(static_cast<size_t>(T) * S);
    EXL3_RETURN_IF_ERROR(inject_->Forward(normed.data(), T, inject->data(), compute));
    for (float& v : *inject) v = 2.0f * Sigmoid(v * inv_streams);
  }
  return absl::OkStatus();
}

void GatedResidual::Expand(const std::vector<float>& inject, const float* out, int T, float* h) const {
  const int S = shape_.streams, H = shape_.hidden;
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < S; ++k) {
      const float a = inject[static_cast<size_t>(t) * S + k];
      float* hk = h + (static_cast<size_t>(t) * S + k) * H;
      const float* o = out + static_cast<size_t>(t) * H;
      for (int i = 0; i < H; ++i) hk[i] += a * o[i];
    }
}

}  // namespace exl3::engine
