// GLM-5.3-Flash's (Glm5NextForConditionalGeneration) own configuration beside ModelConfig's
// fields: the k-pooled indexer's pool size, KDA's forget-gate bound and the hyper-connections.
// engine/config/glm5next_section.h reads it from config.json and tells the fields.
#pragma once

#include <optional>

namespace exl3::engine {

struct Glm5NextConfig {
  int index_kpool = 16;  // P: positions per pool of the indexer
  // KDA's forget gate: log-decay = lower_bound · sigmoid(exp(A_log) · g) with a bound
  // (linear_lower_bound, -5 by default), −exp(A_log) · softplus(g) without one (null).
  std::optional<float> gate_lower_bound;
  int hc_mult = 4;
  int hc_sinkhorn_iters = 20;
  float hc_eps = 1e-6f;
};

}  // namespace exl3::engine
