// One Qwen3-Next gated DeltaNet layer (`linear_attn.*`) on the GPU: the CPU layer's arithmetic
// (engine/cpu/linear_attention/gated_deltanet.h, which states it) on device memory, for CudaModel
// (engine/cuda/cuda_model.h):
//
//   qkvz = in_proj_qkvz(x), ba = in_proj_ba(x)                    (CudaLinear)
//   conv1d + SiLU over [conv state | chunk]; the chunk's last inputs become the conv state
//   q, k L2-normalised, q scaled; β, decay per value head
//   delta rule per (chunk, value head) from the chunk's S, S written back
//   rmsnorm(o) · w · silu(z) → out_proj                           (CudaLinear)
//
// (engine/cuda/deltanet_kernels.h). Qwen4-Exp (Qwen3.5's layout) projects with separate
// in_proj_qkv / in_proj_z / in_proj_b / in_proj_a, regrouped on the device into in_proj_qkvz's and
// in_proj_ba's layout before the conv, and gates the norm with its output_gate_type (SiLU or
// sigmoid). Each chunk's state is read from and written to the device
// state store (engine/cuda/device_sequence_states.h) at the rows the step's chunk table names, so
// the layer's launches are the same for any slots (CUDA graphs replay them).
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cuda/cuda_linear.h"
#include "engine/cuda/deltanet_kernels.h"
#include "engine/cuda/device_array.h"
#include "engine/cuda/recurrent_chunks.h"
#include "engine/config/model_config.h"
#include "model/safetensors.h"

namespace exl3::engine::cuda {

// Device buffers every DeltaNet layer of a model shares, in step rows, grown to the largest step.
struct DeltaNetWorkspace {
  DeviceArray<float> qkvz, ba, conv_out, beta, decay, core;

  // For steps of up to `num_tokens` tokens; *moved: whether any address changed.
  absl::Status Reserve(const LinearAttentionConfig& shape, int num_tokens, bool* moved);
};

class CudaGatedDeltaNet {
 public:
  // `state_offset`: the first float of this layer's state within a store row
  // (DeviceSequenceStates::layer(l) - layer(0)).
  static absl::StatusOr<std::unique_ptr<CudaGatedDeltaNet>> Load(const ModelConfig& cfg,
                                                                 const TensorSource& src, int layer,
                                                                 int64_t state_offset);
  // out rows [first, first + n) of [step tokens, hidden] from the same rows of x (normed); the
  // step's chunks [first_chunk, first_chunk + num_chunks) are exactly those rows' chunks.
  absl::Status Forward(const float* x, int first, int n, const RecurrentStep& step,
                       DeltaNetWorkspace& ws, const CudaLinearContext& ctx, float* out) const;

  DeltaNetDims dims() const { return dims_; }
  std::vector<const CudaLinear*> linears() const;
  int64_t weight_bytes() const;

 private:
  // How the input projections are stored.
  enum class ProjectionLayout {
    kFusedPerKeyHead,  // Qwen3-Next: in_proj_qkvz / in_proj_ba, grouped per key head
    kSeparate,         // Qwen4-Exp: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
  };

  CudaGatedDeltaNet(const ModelConfig& cfg, int64_t state_offset);
  // qkvz and ba rows [first, first + n) of the workspace from x, in either layout.
  absl::Status Project(const float* x, int first, int n, DeltaNetWorkspace& ws, const CudaLinearContext& ctx) const;

  DeltaNetDims dims_;
  float eps_ = 0;
  int hidden_ = 0;
  int64_t state_offset_ = 0;
  ProjectionLayout layout_ = ProjectionLayout::kFusedPerKeyHead;
  DeltaNetOutputGate gate_ = DeltaNetOutputGate::kSilu;
  CudaLinear qkvz_, ba_;        // kFusedPerKeyHead
  CudaLinear qkv_, z_, b_, a_;  // kSeparate
  CudaLinear out_;
  DeviceArray<float> conv_weight_;  // [channels, conv_kernel]
  DeviceArray<float> neg_a_;        // −exp(A_log) [num_value_heads]
  DeviceArray<float> dt_bias_;      // [num_value_heads]
  DeviceArray<float> norm_weight_;  // [value_head_dim]
};

}  // namespace exl3::engine::cuda
