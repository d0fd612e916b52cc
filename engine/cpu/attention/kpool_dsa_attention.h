// GLM-5.3-Flash's indexed attention (`self_attn.*` of its indexed_attention layers; transformers
// 5.25's Glm5NextTextAttention): DeepSeek multi-head latent attention without rope
// (engine/cpu/attention/mla_attention.h with qk_rope_head_dim 0) whose queries each see only the positions of
// the pools a k-pooled indexer picks plus their own incomplete pool (engine/cpu/attention/kpool_indexer.h).
//
// The indexer of a "full" layer (`self_attn.indexer.*`), per token:
//   q_i  = wq_b(normalised q_a_proj output)              [index_n_heads, index_head_dim]
//   k_i  = LayerNorm(wk(x)) (weight and bias, eps 1e-6)  [index_head_dim]
//   gate = index_kpool_compress_gate · x                 [index_head_dim]
//   w    = weights_proj(x) / √index_n_heads
// k_i and gate are cached after the latent in the layer's slot; pool keys are formed from them
// (with index_kpool_compress_ape) for the complete pools a step's queries see. "Shared" layers
// have no indexer and reuse the selection of the layer right before them (the step's
// AttentionCarry).
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "engine/cpu/attention/attention.h"
#include "engine/cpu/attention/indexer_projections.h"
#include "engine/cpu/attention/kpool_indexer.h"
#include "engine/cpu/linear.h"
#include "engine/cpu/attention/mla_attention.h"

namespace exl3::engine {

class KpoolDsaAttention final : public Attention {
 public:
  static absl::StatusOr<std::unique_ptr<KpoolDsaAttention>> Load(const ModelConfig& cfg,
                                                                 const TensorSource& src, int layer);
  absl::Status Forward(const float* x, const StepTokens& tokens, PagedKvCache& cache,
                       AttentionCarry& carry, float* out, CpuCompute& compute) override;

 private:
  struct Indexer {
    IndexerProjections projections;
    Linear compress_gate;
    std::vector<float> ape;  // index_kpool_compress_ape [P, index_head_dim]
  };

  KpoolDsaAttention(const ModelConfig& cfg, int layer);
  // Runs the indexer on the step's tokens (caching their keys and gate scores) and chooses each
  // token's positions.
  absl::Status Select(const float* x, const std::vector<float>& q_resid, const StepTokens& tokens,
                      PagedKvCache& cache, TopkSelection* selection, CpuCompute& compute) const;

  const ModelConfig& cfg_;
  int layer_;
  KpoolShape shape_;
  std::unique_ptr<MlaAttention> mla_;
  std::optional<Indexer> indexer_;  // unset on "shared" layers
};

}  // namespace exl3::engine
