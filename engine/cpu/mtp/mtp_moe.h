// The MoE block of a checkpoint's MTP layer (engine/cpu/mtp/mtp_head.h), run in the engine's process
// from the layer's own tensors: router (mlp.gate.weight and the correction bias), routed experts
// (mlp.experts.E.{gate,up,down}_proj) and the shared expert (mlp.shared_experts.*; Qwen4-Exp's
// mlp.shared_expert.* scaled by sigmoid(x · mlp.shared_expert_gate)), each linear EXL3 or dense
// as stored (engine/cpu/linear.h). The routing function is the model's (model/routing.h), for the
// layer index num_hidden_layers.
//
//   EXL3_ASSIGN_OR_RETURN(MtpMoe moe, MtpMoe::Load(cfg, src, /*layer=*/cfg.num_layers));
//   // or with the layer's tensors under a prefix of their own (Qwen4-Exp: "mtp.layers.0."):
//   EXL3_ASSIGN_OR_RETURN(MtpMoe moe, MtpMoe::Load(cfg, src, cfg.num_layers, "mtp.layers.0."));
//   EXL3_RETURN_IF_ERROR(moe.Forward(x /*[T, hidden]*/, T, y /*[T, hidden]*/, compute));
//
// The expert workers serve the decoder layers 0 .. num_hidden_layers - 1 only, so this block's
// experts stay with the engine whether the model's experts run here or on workers.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cpu/cpu_compute.h"
#include "engine/cpu/linear.h"
#include "engine/config/model_config.h"
#include "model/moe_config.h"
#include "model/safetensors.h"

namespace exl3::engine {

class MtpMoe {
 public:
  static absl::StatusOr<MtpMoe> Load(const ModelConfig& cfg, const TensorSource& src, int layer);
  // The tensors named as layer `layer`'s with its prefix (LayerPrefix) replaced by `layer_prefix`.
  static absl::StatusOr<MtpMoe> Load(const ModelConfig& cfg, const TensorSource& src, int layer,
                                     const std::string& layer_prefix);
  // y [T, hidden] = Σ_k weight_k · expert_k(x) + shared(x) (gated: · sigmoid(x · gate)).
  absl::Status Forward(const float* x, int num_tokens, float* y, CpuCompute& compute) const;

 private:
  struct Mlp {
    Linear gate, up, down;
  };
  absl::Status RunMlp(const Mlp& mlp, float limit, const float* x, int num_tokens, float* y,
                      CpuCompute& compute) const;

  MoeConfig routing_;  // the model's, with this layer counted as a MoE layer
  int layer_ = 0;
  std::vector<float> router_;  // [num_experts, hidden]
  std::vector<float> bias_;    // [num_experts] or empty
  std::vector<Mlp> experts_;
  std::vector<Mlp> shared_;    // zero or one
  std::vector<float> shared_gate_;  // [hidden] (Qwen4-Exp's gated shared expert), or empty
};

}  // namespace exl3::engine
