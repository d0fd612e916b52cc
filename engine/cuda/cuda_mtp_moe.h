// The MoE block of a checkpoint's MTP layer on the GPU (engine/cuda/cuda_mtp_head.h,
// cuda_qwen4exp_mtp_head.h): the CPU engine's engine/cpu/mtp/mtp_moe.h through the GPU engine's MoE
// (engine/cuda/cuda_moe.h: the gate on the device, the fused expert kernels), with the layer's own
// router, correction bias, routed experts, shared expert (Qwen4-Exp's gated by
// sigmoid(x · shared_expert_gate)) and the model's routing function. The experts must be EXL3 (the
// kernels' format; a dense expert is refused naming its tensor) and stay in process even where the
// model's experts are on workers (the workers serve the decoder layers only).
//
//   EXL3_ASSIGN_OR_RETURN(CudaMtpMoe moe, CudaMtpMoe::Load(cfg, src, cfg.num_layers - 1, prefix, tokens, linear));
//   EXL3_RETURN_IF_ERROR(moe.Reserve(T));
//   EXL3_RETURN_IF_ERROR(moe.Forward(step, x, T, d));
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/config/model_config.h"
#include "engine/cuda/cuda_linear.h"
#include "engine/cuda/cuda_moe.h"
#include "engine/cuda/step_facts.h"
#include "engine/cuda/weight_bytes.h"
#include "model/safetensors.h"

namespace exl3::engine::cuda {

class CudaMtpMoe {
 public:
  // Layer `layer` of `cfg` (the model's with its MTP layer, which `cfg` must count as MoE and which
  // must outlive the block), its tensors under `layer_prefix` (ending in '.'; the layer's own
  // LayerPrefix, or Qwen4-Exp's "mtp.layers.0."); `max_moe_tokens` rows of the kernels' workspace.
  static absl::StatusOr<CudaMtpMoe> Load(const ModelConfig& cfg, const TensorSource& src, int layer,
                                         const std::string& layer_prefix, int max_moe_tokens,
                                         const CudaLinearContext& linear);
  absl::Status Reserve(int rows);
  // d [T, hidden] = the block's output for x [T, hidden], the step's rows.
  absl::Status Forward(const CudaStep& step, const float* x, int num_tokens, float* d);

 private:
  std::unique_ptr<CudaMoe> moe_;
  std::unique_ptr<CudaMoeLayer> layer_;
  CudaWeightBytes weight_bytes_;
};

}  // namespace exl3::engine::cuda
