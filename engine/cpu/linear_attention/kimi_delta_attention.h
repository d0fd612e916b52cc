// GLM-5.3-Flash's KDA layer (`self_attn.*` of its linear_attention layers; transformers 5.25's
// Glm5NextTextLinearAttention) on the CPU, in fp32. Per token, x the input-normed hidden state,
// heads of D = linear_head_dim:
//
//   q, k, v = q_proj(x), k_proj(x), v_proj(x)                         [heads × D] each
//   each → its causal depthwise conv (q_conv1d / k_conv1d / v_conv1d, conv_kernel taps, no bias)
//   → SiLU; q, k L2-normalised per head (x / √(Σx² + 1e-6)), q scaled by D^-1/2
//   g = f_b_proj(f_a_proj(x)) + dt_bias                               [heads × D], per channel
//   log-decay = lower_bound · sigmoid(exp(A_log[h]) · g)   (no bound: −exp(A_log[h]) · softplus(g))
//   β = sigmoid(b_proj(x))                                            [heads]
//   per head the Kimi delta rule (engine/cpu/linear_attention/kimi_delta_rule.h) over S [D, D]
//   o → RMSNorm over D (o_norm.weight, rms_norm_eps) · sigmoid(g_b_proj(g_a_proj(x))) → o_proj
//
// A chunk of one token or a verify chunk runs the recurrent form, a longer one the chunked form
// (chunks of 64), as transformers runs decode and prefill. Per layer and sequence the state (engine/cpu/sequence_state.h)
// is the last conv_kernel − 1 conv inputs [conv_kernel − 1, 3 × heads × D] (q, k, v channels in
// that order), then S of every head [heads, D, D]; zero at position 0.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cpu/linear.h"
#include "engine/cpu/linear_attention/linear_attention.h"

namespace exl3::engine {

// One KDA layer's weights as stored (the linears as engine/cpu/linear.h loads them, the rest fp32): the
// CPU layer runs on them, the GPU layer (engine/cuda/cuda_kimi_delta_attention.h) uploads them.
struct KdaWeights {
  Linear q, k, v, f_a, f_b, b, g_a, g_b, o;
  std::vector<float> conv_weight;  // [3 × heads × D, conv_kernel]: q, k, v channels
  std::vector<float> decay_rate;   // exp(A_log) [heads]
  std::vector<float> dt_bias;      // [heads × D]
  std::vector<float> o_norm;       // [D]

  static absl::StatusOr<KdaWeights> Load(const ModelConfig& cfg, const TensorSource& src, int layer);
};

class KimiDeltaAttention final : public LinearAttention {
 public:
  static absl::StatusOr<std::unique_ptr<KimiDeltaAttention>> Load(const ModelConfig& cfg,
                                                                  const TensorSource& src, int layer);
  absl::Status Forward(const float* x, const StepTokens& tokens, SequenceStateStore& states,
                       float* out, CpuCompute& compute) const override;

  static constexpr int kChunkSize = 64;  // transformers' chunk_kimi_delta_attention default

 private:
  KimiDeltaAttention(const ModelConfig& cfg, int layer);

  const ModelConfig& cfg_;
  const LinearAttentionConfig shape_;  // heads and D for q, k and v alike
  int layer_;
  std::optional<float> lower_bound_;
  KdaWeights w_;
};

}  // namespace exl3::engine
