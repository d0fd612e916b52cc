// The plain residual stream on the GPU (engine/cuda/residual_stream.h): one stream per token
// h [rows, hidden]; a block's output joins it and the next norm reads it in one launch
// (h += d; x = rmsnorm(h) · w), input_layernorm and post_attention_layernorm per layer, the final
// norm before the head. Every model without hyper-connections runs on it.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "engine/cuda/residual_stream.h"

namespace exl3::engine::cuda {

absl::StatusOr<std::unique_ptr<ResidualStream>> LoadPlainResidual(const ModelConfig& cfg, const TensorSource& src,
                                                                  StreamHandle stream);

}  // namespace exl3::engine::cuda
