// One of Qwen4-Exp's PLE layers on the GPU (`layers.N.ple.*`; the CPU engine's engine/cpu/residual/ple_layer.h
// states the arithmetic): the n-gram rows are read on the host with the CPU layer's reader (pread,
// the table never mapped whole) for each step's windows (engine/cuda/ple_windows.h) and uploaded with
// the step; the rest runs on the device:
//
//   key = norm_key(key_proj(e)), value = value_proj(e)       (CudaLinear; per-stream norms)
//   query = norm_query(h); v_k = sigmoid(g_k) · value         (engine/cuda/ple_kernels.h PleGate)
//   h_k += v_k + silu(dilated causal conv(norm_conv(v)))      (PleConv over the carried inputs)
//
// The conv's carried inputs live where the CPU engine keeps them: in the layer's part of the
// recurrent state store's row (engine/cuda/recurrent_layer_states.h), after the DeltaNet's state and
// the context tokens' floats (the GPU engine keeps the context tokens on the host, so those floats
// stay unused here), read from each chunk's read row and written to its write row.
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cuda/cuda_linear.h"
#include "engine/cuda/device_array.h"
#include "engine/cuda/ple_kernels.h"
#include "engine/cuda/recurrent_chunks.h"
#include "engine/config/model_config.h"
#include "engine/cpu/residual/ple_layer.h"
#include "model/safetensors.h"

namespace exl3::engine::cuda {

// The device buffers every PLE layer of a model shares, in step rows.
struct PleWorkspace {
  DeviceArray<float> key, query, v, normed;  // [T, streams · hidden]
  DeviceArray<float> value;                  // [T, hidden]

  // For steps of up to `rows` rows; *moved: whether an address changed.
  absl::Status Reserve(const PleShape& shape, int rows, bool* moved);
};

class CudaPleLayer {
 public:
  static absl::StatusOr<std::unique_ptr<CudaPleLayer>> Load(const ModelConfig& cfg, const TensorSource& src,
                                                            int layer);

  // Host: e [T, embed_dim] = the n-gram rows of windows [T, ngram_size] (PleLayer::Embed).
  absl::Status Embed(const int32_t* windows, int num_tokens, float* e) const {
    return host_->Embed(windows, num_tokens, e);
  }
  // h [step rows, streams, hidden] rows [first, first + n) += the layer's output; e [step rows,
  // embed_dim] on the device; `step` the recurrent store's chunks of those rows.
  absl::Status Forward(float* h, const float* e, int first, int n, const RecurrentStep& step, PleWorkspace& ws,
                       const CudaLinearContext& ctx) const;

  const PleShape& shape() const { return shape_; }
  int embed_dim() const { return embed_dim_; }
  std::vector<const CudaLinear*> linears() const { return {&key_, &value_}; }

 private:
  CudaPleLayer() = default;

  std::unique_ptr<PleLayer> host_;  // the table's reader and hashing
  PleShape shape_;
  int embed_dim_ = 0;
  float eps_ = 0.0f;
  int64_t state_offset_ = 0;  // floats before this layer's carried conv inputs within a store row
  CudaLinear key_, value_;
  DeviceArray<float> norm_key_, norm_query_, norm_conv_;  // 1 + w [streams · hidden]
  DeviceArray<float> conv_weight_;                        // [streams · hidden, conv_kernel]
};

}  // namespace exl3::engine::cuda
