// Qwen4-Exp's residual stream on the GPU (engine/cuda/residual_stream.h): hc_count streams per
// token [rows, S, hidden], all the token's embedding at the start; each block's input collapsed
// from them by its low-rank gated hyper-connection and its output expanded back with the
// connection's inject weights (engine/cuda/gated_connection.h; the CPU engine's
// engine/cpu/residual/gated_residual.h). No layer norms and no final norm: the head's input is
// `hyper_connection_mixer`'s collapse of each logit row's streams.
#pragma once

#include <memory>

#include "engine/cuda/cuda_linear.h"
#include "engine/cuda/residual_stream.h"

namespace exl3::engine::cuda {

absl::StatusOr<std::unique_ptr<ResidualStream>> LoadGatedResidual(const ModelConfig& cfg, const TensorSource& src,
                                                                  const CudaLinearContext& ctx);

}  // namespace exl3::engine::cuda
