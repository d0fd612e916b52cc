#include "engine/cpu/attention/indexer_projections.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace exl3::engine {
namespace {

constexpr float kIndexerNormEps = 1e-6f;  // the indexer's k_norm (nn.LayerNorm(eps=1e-6))

// LayerNorm with weight and bias over n values, in place (mean and variance in double).
void LayerNormInPlace(float* x, const float* w, const float* b, int n, float eps) {
  double mean = 0.0;
  for (int i = 0; i < n; ++i) mean += x[i];
  mean /= n;
  double var = 0.0;
  for (int i = 0; i < n; ++i) var += (x[i] - mean) * (x[i] - mean);
  var /= n;
  const float inv = static_cast<float>(1.0 / std::sqrt(var + eps));
  const float m = static_cast<float>(mean);
  for (int i = 0; i < n; ++i) x[i] = (x[i] - m) * inv * w[i] + b[i];
}

}  // namespace

absl::StatusOr<std::optional<IndexerProjections>> IndexerProjections::Load(const ModelConfig& cfg,
                                                                           const TensorSource& src, int layer,
                                                                           const std::string& p) {
  const bool has_tensors = src.Has(p + "wk.weight") || src.Has(p + "wk.trellis");
  if (!cfg.HasOwnIndexer(layer)) {
    if (has_tensors)
      return absl::InvalidArgumentError(absl::StrCat(
          p, "*: layer ", layer, " has indexer weights but config.json marks it shared"));
    return std::nullopt;
  }
  const int H = cfg.hidden_size, NI = cfg.indexer.num_heads, DI = cfg.indexer.head_dim;
  IndexerProjections in;
  EXL3_ASSIGN_OR_RETURN(in.wq_b, Linear::Load(src, p + "wq_b", cfg.q_lora_rank, NI * DI));
  EXL3_ASSIGN_OR_RETURN(in.wk, Linear::Load(src, p + "wk", H, DI));
  EXL3_ASSIGN_OR_RETURN(in.weights_proj, Linear::Load(src, p + "weights_proj", H, NI));
  EXL3_ASSIGN_OR_RETURN(in.k_norm_weight, LoadVector(src, p + "k_norm.weight", DI));
  EXL3_ASSIGN_OR_RETURN(in.k_norm_bias, LoadVector(src, p + "k_norm.bias", DI));
  return in;
}

absl::Status IndexerProjections::Forward(const float* x, const float* q_resid, int T, int heads, int head_dim,
                                         float* q, float* k, float* w, CpuCompute& compute) const {
  EXL3_RETURN_IF_ERROR(wq_b.Forward(q_resid, T, q, compute));
  EXL3_RETURN_IF_ERROR(wk.Forward(x, T, k, compute));
  EXL3_RETURN_IF_ERROR(weights_proj.Forward(x, T, w, compute));
  const float head_weight = static_cast<float>(1.0 / std::sqrt(static_cast<double>(heads)));
  for (size_t i = 0; i < static_cast<size_t>(T) * heads; ++i) w[i] *= head_weight;
  for (int t = 0; t < T; ++t)
    LayerNormInPlace(k + static_cast<size_t>(t) * head_dim, k_norm_weight.data(), k_norm_bias.data(), head_dim,
                     kIndexerNormEps);
  return absl::OkStatus();
}

}  // namespace exl3::engine
