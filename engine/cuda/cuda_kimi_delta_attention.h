// One GLM-5.3-Flash KDA layer (`self_attn.*` of its linear_attention layers) on the GPU: the CPU
// layer's arithmetic (engine/cpu/linear_attention/kimi_delta_attention.h, which states it) on device memory, for the KDA
// mixer kind (engine/cuda/recurrent_mixer.h):
//
//   q, k, v = q_proj(x), k_proj(x), v_proj(x); f_b_proj(f_a_proj(x)), g_b_proj(g_a_proj(x)),
//   b_proj(x)                                                         (CudaLinear)
//   conv1d + SiLU over [conv state | chunk]; the chunk's last inputs become the conv state
//   q, k L2-normalised, q scaled; the per-channel log-decay, β
//   Kimi delta rule per (chunk, head) from the chunk's S, S written back
//   rmsnorm(o) · w · sigmoid(gate) → o_proj                           (CudaLinear)
//
// (engine/cuda/kda_kernels.h). Unlike the CPU layer, which runs a chunk of several tokens in the
// chunked form, the GPU runs every chunk token by token (the recurrent form): the same outputs and
// state up to fp32 rounding (engine/cpu/linear_attention/kimi_delta_rule.h). Each chunk's state is read from and
// written to the device state store (engine/cuda/device_sequence_states.h) at the rows the step's
// chunk table names, so the layer's launches are the same for any slots (CUDA graphs replay them).
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cuda/cuda_linear.h"
#include "engine/cuda/device_array.h"
#include "engine/cuda/kda_kernels.h"
#include "engine/cuda/recurrent_chunks.h"
#include "engine/config/model_config.h"
#include "model/safetensors.h"

namespace exl3::engine::cuda {

// Device buffers every KDA layer of a model shares, in step rows, grown to the largest step.
struct KdaWorkspace {
  DeviceArray<float> q, k, v;           // [rows, W] the projections
  DeviceArray<float> f_low, g_low;      // [rows, D] f_a_proj's and g_a_proj's outputs
  DeviceArray<float> log_decay, gate;   // [rows, W] f_b_proj's (then the log-decay), g_b_proj's
  DeviceArray<float> beta;              // [rows, heads] b_proj's (then β)
  DeviceArray<float> conv_out, core;    // [rows, 3 W], [rows, W]

  // For steps of up to `rows` rows; *moved: whether any address changed.
  absl::Status Reserve(const LinearAttentionConfig& shape, int rows, bool* moved);
};

class CudaKimiDeltaAttention {
 public:
  // `state_offset`: the first float of this layer's state within a store row
  // (DeviceSequenceStates::layer(l) - layer(0)). The forget gate's form comes from cfg.glm5next.
  static absl::StatusOr<std::unique_ptr<CudaKimiDeltaAttention>> Load(const ModelConfig& cfg,
                                                                      const TensorSource& src,
                                                                      int layer,
                                                                      int64_t state_offset);
  // out rows [first, first + n) of [step rows, hidden] from the same rows of x (normed); the
  // step's chunks [first_chunk, first_chunk + num_chunks) are exactly those rows' chunks.
  absl::Status Forward(const float* x, int first, int n, const RecurrentStep& step,
                       KdaWorkspace& ws, const CudaLinearContext& ctx, float* out) const;

  KdaDims dims() const { return dims_; }
  std::vector<const CudaLinear*> linears() const {
    return {&q_, &k_, &v_, &f_a_, &f_b_, &b_, &g_a_, &g_b_, &o_};
  }
  int64_t weight_bytes() const;

 private:
  CudaKimiDeltaAttention(const ModelConfig& cfg, int64_t state_offset);

  KdaDims dims_;
  KdaForgetGate gate_;
  float eps_ = 0;
  int hidden_ = 0;
  int64_t state_offset_ = 0;
  CudaLinear q_, k_, v_, f_a_, f_b_, b_, g_a_, g_b_, o_;
  DeviceArray<float> conv_weight_;  // [3 W, conv_kernel]: q, k, v channels
  DeviceArray<float> decay_rate_;   // exp(A_log) [heads]
  DeviceArray<float> dt_bias_;      // [W]
  DeviceArray<float> o_norm_;       // [D]
};

}  // namespace exl3::engine::cuda
