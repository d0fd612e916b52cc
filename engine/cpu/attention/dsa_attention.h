// GLM-MoE-DSA's attention: DeepSeek multi-head latent attention (engine/cpu/attention/mla_attention.h) whose
// queries each see only the top-k earlier positions a lightning indexer scores highest
// (DeepSeek sparse attention, as transformers' GlmMoeDsaAttention computes it).
//
// The indexer of layer L (`self_attn.indexer.*`), per token:
//   q_i = wq_b(normalised q_a_proj output)        [index_n_heads, index_head_dim]
//   k_i = LayerNorm(wk(x)) (weight and bias, eps 1e-6)           [index_head_dim]
//   both rotated on their first qk_rope_head_dim dimensions (interleaved, the model's angles)
//   w   = weights_proj(x) / sqrt(index_n_heads)                  [index_n_heads]
//   score(query t, position j) = Σ_h w[h] · relu(q_i[t, h] · k_i[j] / sqrt(index_head_dim))
// over the positions j ≤ t's own; t attends to the index_topk highest (ties: the earlier
// position first), or to all of them while there are no more than index_topk. k_i is cached
// after the MLA latent and rope key in the layer's slot. Layers whose indexer type is "shared"
// have no indexer and no indexer keys: they reuse the selection of the last layer that ran one
// (handed over in the step's AttentionCarry).
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "engine/cpu/attention/attention.h"
#include "engine/cpu/attention/indexer_projections.h"
#include "engine/cpu/linear.h"
#include "engine/cpu/attention/mla_attention.h"

namespace exl3::engine {

class DsaAttention final : public Attention {
 public:
  static absl::StatusOr<std::unique_ptr<DsaAttention>> Load(const ModelConfig& cfg,
                                                            const TensorSource& src, int layer);
  absl::Status Forward(const float* x, const StepTokens& tokens, PagedKvCache& cache,
                       AttentionCarry& carry, float* out, CpuCompute& compute) override;

 private:

  DsaAttention(const ModelConfig& cfg, int layer) : cfg_(cfg), layer_(layer) {}
  // Runs the indexer on the step's tokens (writing their indexer keys to the cache) and chooses
  // each token's positions.
  absl::Status Select(const float* x, const std::vector<float>& q_resid, const StepTokens& tokens,
                      PagedKvCache& cache, TopkSelection* selection, CpuCompute& compute) const;

  const ModelConfig& cfg_;
  int layer_;
  std::unique_ptr<MlaAttention> mla_;
  std::optional<IndexerProjections> indexer_;  // unset on "shared" layers
};

}  // namespace exl3::engine
