// Grouped-query attention (Glm4Moe, Qwen3Moe, Mixtral, Qwen3-Next's full-attention layers): q/k/v
// projections (optional bias), optional per-head q/k RMSNorm, RoPE on each head's leading
// rotary_dim dimensions, softmax over the visible cached positions, o_proj. With an output gate
// (Qwen3-Next), q_proj gives each head's query followed by a gate of head_dim, and the attention
// output is multiplied by sigmoid(gate) before o_proj. A cache slot holds [k of every KV head,
// v of every KV head].
#pragma once

#include <memory>
#include <vector>

#include "engine/cpu/attention/attention.h"
#include "engine/cpu/linear.h"
#include "engine/cpu/rope.h"

namespace exl3::engine {

class GqaAttention final : public Attention {
 public:
  static absl::StatusOr<std::unique_ptr<GqaAttention>> Load(const ModelConfig& cfg,
                                                            const TensorSource& src, int layer);
  absl::Status Forward(const float* x, const StepTokens& tokens, PagedKvCache& cache,
                       AttentionCarry& carry, float* out,
                       CpuCompute& compute) override;

 private:
  GqaAttention(const ModelConfig& cfg, int layer);

  const ModelConfig& cfg_;
  int layer_;
  Rope rope_;
  Linear q_, k_, v_, o_;
  std::vector<float> q_norm_, k_norm_;  // [head_dim] each, empty without qk norm
  bool output_gate_ = false;
};

}  // namespace exl3::engine
