// The CUDA model's residual-stream factory: the kind of stream (engine/cuda/residual_stream.h) the
// model's configuration asks for, with every layer's norms (and hyper-connections) and the final
// norm. The kinds' headers include the interface, never this factory.
//
//   EXL3_ASSIGN_OR_RETURN(std::unique_ptr<ResidualStream> stream, LoadResidualStream(cfg, src, ctx));
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "engine/cuda/cuda_linear.h"
#include "engine/cuda/residual_stream.h"
#include "engine/config/model_config.h"
#include "model/safetensors.h"

namespace exl3::engine::cuda {

// DeepSeek-V4 and GLM-5.3-Flash: hyper-connected (engine/cuda/hyper_residual.h); Qwen4-Exp: gated
// (engine/cuda/gated_residual_stream.h); every other model: plain (engine/cuda/plain_residual_stream.h).
// Every launch goes on ctx.stream (the gated kind's projections through ctx).
absl::StatusOr<std::unique_ptr<ResidualStream>> LoadResidualStream(const ModelConfig& cfg, const TensorSource& src,
                                                                   const CudaLinearContext& ctx);

}  // namespace exl3::engine::cuda
