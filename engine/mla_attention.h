// DeepSeek multi-head latent attention. Queries through q_a_proj → q_a_layernorm → q_b_proj (or
// one q_proj), split per head into a no-rope part and a rope part; kv_a_proj_with_mqa gives the
// latent (kv_a_layernorm'd) and one rope key shared by all heads. A cache slot holds
// [latent (kv_lora_rank), rotated shared key (qk_rope_head_dim)], as transformers caches it.
//
// kv_b_proj is absorbed: for head h, q_nope · W_uk(h) maps the query into the latent space, the
// scores are that · latent + q_rope · k_rope, and the output is W_uv(h) · (softmax-weighted sum of
// latents). The same arithmetic as expanding every cached latent into keys and values, reordered.
#pragma once

#include <memory>
#include <vector>

#include "engine/attention.h"
#include "engine/linear.h"
#include "engine/rope.h"

namespace exl3::engine {

class MlaAttention final : public Attention {
 public:
  static absl::StatusOr<std::unique_ptr<MlaAttention>> Load(const ModelConfig& cfg,
                                                            const TensorSource& src, int layer);
  absl::Status Forward(const float* x, const StepTokens& tokens, PagedKvCache& cache, float* out,
                       CpuCompute& compute) override;

 private:
  MlaAttention(const ModelConfig& cfg, int layer);
  absl::Status Queries(const float* x, int num_tokens, float* q, CpuCompute& compute) const;

  const ModelConfig& cfg_;
  int layer_;
  Rope rope_;
  bool q_low_rank_ = false;
  Linear q_a_, q_b_, q_, kv_a_, o_;
  std::vector<float> q_a_norm_, kv_a_norm_;
  std::vector<float> kv_b_;  // [heads * (nope + v), kv_lora_rank] fp32
};

}  // namespace exl3::engine
