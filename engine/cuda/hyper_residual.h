// DeepSeek-V4's hyper-connected residual stream on the GPU (engine/cuda/residual_stream.h): hc_mult
// streams per token [rows, N, hidden]; before each block a hyper-connection collapses them into
// the block's input (and its post / comb mix), after it expands the block's output back into them
// (engine/cuda/hyper_connection_kernels.h, the CPU engine's engine/hyper_connections.h); the head
// collapses each logit row's streams (model.hc_head) before the final norm. The norms are
// attn_norm / ffn_norm, as the checkpoints name them.
#pragma once

#include <memory>

#include "engine/cuda/residual_stream.h"

namespace exl3::engine::cuda {

absl::StatusOr<std::unique_ptr<ResidualStream>> LoadHyperResidual(const ModelConfig& cfg, const TensorSource& src,
                                                                  StreamHandle stream);

}  // namespace exl3::engine::cuda
