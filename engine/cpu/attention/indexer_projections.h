// The projections every lightning indexer of DeepSeek sparse attention starts from, per token:
//   q_i = wq_b(q_resid)                                 [index_n_heads, index_head_dim]
//   k_i = LayerNorm(wk(x)) (weight and bias, eps 1e-6)  [index_head_dim]
//   w   = weights_proj(x) / sqrt(index_n_heads)         [index_n_heads]
// (q_resid: MLA's normalised q_a_proj output). GLM-MoE-DSA's indexer
// (engine/cpu/attention/dsa_attention.h) rotates q_i and k_i and scores positions with them;
// GLM-5.3-Flash's k-pooled one (kpool_dsa_attention.h) scores pools of keys.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/config/model_config.h"
#include "engine/cpu/cpu_compute.h"
#include "engine/cpu/linear.h"
#include "model/safetensors.h"

namespace exl3::engine {

struct IndexerProjections {
  Linear wq_b, wk, weights_proj;
  std::vector<float> k_norm_weight, k_norm_bias;  // LayerNorm over index_head_dim

  // Layer `layer`'s projections under `prefix` (its `self_attn.indexer.`); nullopt on a layer whose
  // indexer config.json marks "shared" (it reuses an earlier layer's selection), which must store
  // no indexer weights (InvalidArgument naming them).
  static absl::StatusOr<std::optional<IndexerProjections>> Load(const ModelConfig& cfg, const TensorSource& src,
                                                                int layer, const std::string& prefix);

  // For T tokens: q [T, heads * head_dim] from q_resid [T, q_lora_rank], k [T, head_dim] (normed)
  // and w [T, heads] (scaled) from x [T, hidden].
  absl::Status Forward(const float* x, const float* q_resid, int T, int heads, int head_dim, float* q, float* k,
                       float* w, CpuCompute& compute) const;
};

}  // namespace exl3::engine
