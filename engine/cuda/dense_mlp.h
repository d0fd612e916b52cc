// A dense layer's SwiGLU MLP on the GPU: out = down_proj(silu(gate_proj(x)) · up_proj(x)), as the CPU
// engine's dense MLP: with GLM-5.3-Flash's clamp where the model has one (ModelConfig's
// dense_swiglu_limit > 0: gate ≤ limit, up in [-limit, limit] before the product). gate and up
// [T, intermediate] are the model's step buffers.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cuda/cuda_linear.h"

namespace exl3::engine::cuda {

class CudaDenseMlp {
 public:
  // `prefix`: "model.layers.L.mlp."; swiglu_limit 0: no clamp.
  static absl::StatusOr<CudaDenseMlp> Load(const TensorSource& src, const std::string& prefix, int hidden,
                                           int intermediate, float swiglu_limit);
  // out [T, hidden] from x [T, hidden]; gate, up [T, intermediate] scratch.
  absl::Status Forward(const float* x, int num_tokens, float* gate, float* up, float* out,
                       const CudaLinearContext& ctx) const;
  int64_t weight_bytes() const { return gate_.weight_bytes() + up_.weight_bytes() + down_.weight_bytes(); }
  std::vector<const CudaLinear*> linears() const { return {&gate_, &up_, &down_}; }

 private:
  CudaLinear gate_, up_, down_;
  float swiglu_limit_ = 0.0f;  // 0: no clamp
};

}  // namespace exl3::engine::cuda
