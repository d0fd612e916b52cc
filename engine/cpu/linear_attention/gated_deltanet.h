// Qwen3-Next's linear attention layer (`linear_attn.*`, transformers' Qwen3NextGatedDeltaNet) on
// the CPU, in fp32. Per token, with x the input-normed hidden state:
//
//   in_proj_qkvz(x) → per key head g: q_g, k_g [key_head_dim], then v and z for its value heads
//   in_proj_ba(x)   → per key head g: b, then a, for its value heads
//   [q | k | v] → causal depthwise conv1d (conv_kernel taps, no bias) → SiLU
//   q, k: L2-normalised per head (eps 1e-6), q scaled by key_head_dim^-1/2
//   β = sigmoid(b), decay = exp(−exp(A_log) · softplus(a + dt_bias))         per value head
//   S ← decay·S;  S ← S + k ⊗ β(v − Sᵀk);  o = Sᵀq      (S [key_head_dim, value_head_dim])
//   o → RMSNorm over value_head_dim (weight `norm.weight`, used as is) · SiLU(z) → out_proj
//
// Qwen4-Exp (Qwen3.5's layout) projects with separate `in_proj_qkv` ([q of every key head | k |
// v of every value head]), `in_proj_z`, `in_proj_b` and `in_proj_a` instead, and gates the norm's
// output with act(z), act its output_gate_type (SiLU or sigmoid); the recurrence is the same.
//
// Value head h uses key head h / (num_value_heads / num_key_heads). transformers computes a
// prefill with the chunked form of the same recurrence; this runs it token by token (equal up to
// fp32 rounding). What a sequence carries from one step to the next, per layer, is its state in
// engine/cpu/sequence_state.h: the last conv_kernel − 1 conv inputs [conv_kernel − 1, channels], then
// S of every value head [num_value_heads, key_head_dim, value_head_dim], zero at position 0.
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cpu/cpu_compute.h"
#include "engine/cpu/linear.h"
#include "engine/cpu/linear_attention/linear_attention.h"
#include "engine/config/model_config.h"
#include "engine/config/qwen4exp_config.h"
#include "engine/cpu/sequence_state.h"
#include "engine/core/step_tokens.h"
#include "model/safetensors.h"

namespace exl3::engine {

class GatedDeltaNet final : public LinearAttention {
 public:
  static absl::StatusOr<std::unique_ptr<GatedDeltaNet>> Load(const ModelConfig& cfg,
                                                             const TensorSource& src, int layer);
  // out [T, hidden] from x [T, hidden]. Each chunk reads its sequence's state from
  // states.Current(layer, slot) and writes the states it keeps (KeptState; the last is Next).
  absl::Status Forward(const float* x, const StepTokens& tokens, SequenceStateStore& states,
                       float* out, CpuCompute& compute) const override;

 private:
  // How the input projections are stored.
  enum class ProjectionLayout {
    kFusedPerKeyHead,  // Qwen3-Next: in_proj_qkvz / in_proj_ba, grouped per key head
    kSeparate,         // Qwen4-Exp: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
  };
  struct Projected {
    std::vector<float> mixed;      // [T, conv channels]: q | k | v
    std::vector<float> z;          // [T, value heads, value_head_dim]
    std::vector<float> beta;       // [T, value heads]
    std::vector<float> log_decay;  // [T, value heads]
  };

  GatedDeltaNet(const ModelConfig& cfg, int layer) : cfg_(cfg), shape_(cfg.linear_attention), layer_(layer) {}
  absl::Status Project(const float* x, int num_tokens, Projected* p, CpuCompute& compute) const;

  const ModelConfig& cfg_;
  const LinearAttentionConfig shape_;
  int layer_;
  ProjectionLayout layout_ = ProjectionLayout::kFusedPerKeyHead;
  OutputGateActivation gate_activation_ = OutputGateActivation::kSilu;
  Linear qkvz_, ba_;      // kFusedPerKeyHead
  Linear qkv_, z_, b_, a_;  // kSeparate
  Linear out_;
  std::vector<float> conv_weight_;  // [channels, conv_kernel]
  std::vector<float> neg_a_;        // −exp(A_log) [num_value_heads]
  std::vector<float> dt_bias_;      // [num_value_heads]
  std::vector<float> norm_weight_;  // [value_head_dim]
};

}  // namespace exl3::engine
