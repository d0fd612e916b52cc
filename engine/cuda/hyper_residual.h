// The hyper-connected residual stream on the GPU (engine/cuda/residual_stream.h) of DeepSeek-V4 and
// GLM-5.3-Flash: hc_mult streams per token [rows, N, hidden]; before each block a hyper-connection
// collapses them into the block's input (and its post / comb mix), after it expands the block's
// output back into them (engine/cuda/hyper_connection_kernels.h, the CPU engine's
// engine/cpu/residual/hyper_connections.h); the head collapses each logit row's streams before the final norm.
// A collapse's post / comb, read only by the expand after the block, are formed on a side stream
// (HyperMixStream) while the block runs, and joined back before that expand (EXL3_HC_MIX_STREAM=0:
// on the model's stream).
// What differs, chosen at load from the config:
//   DeepSeek-V4     norms attn_norm / ffn_norm (the checkpoints' names), a learned head (model.hc_head)
//   GLM-5.3-Flash   norms input_layernorm / post_attention_layernorm under model.language_model.,
//                   the head the streams' mean (HyperHead::Mean)
#pragma once

#include <memory>
#include <string>

#include "engine/cpu/residual/hyper_connections.h"
#include "engine/cuda/device_array.h"
#include "engine/cuda/hyper_connection_kernels.h"
#include "engine/cuda/residual_stream.h"

namespace exl3::engine::cuda {

// One hyper-connection's weights on the device (the layers' hc_attn_ / hc_ffn_, and the DSPARK
// drafter's blocks', engine/cuda/cuda_dspark_drafter.h).
struct HyperConnectionWeights {
  DeviceArray<float> fn, base;
  HyperConnectionArgs args;  // fn and base point into the arrays above
};
// The hyper-connection `prefix`{fn, base, scale} of `src` (HyperConnection::Load), uploaded.
absl::StatusOr<HyperConnectionWeights> UploadHyperConnection(const TensorSource& src, const std::string& prefix,
                                                             const HyperConnectionShape& shape);

absl::StatusOr<std::unique_ptr<ResidualStream>> LoadHyperResidual(const ModelConfig& cfg, const TensorSource& src,
                                                                  StreamHandle stream);

}  // namespace exl3::engine::cuda
