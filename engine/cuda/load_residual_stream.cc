#include "engine/cuda/load_residual_stream.h"

#include "engine/cuda/gated_residual_stream.h"
#include "engine/cuda/hyper_residual.h"
#include "engine/cuda/plain_residual_stream.h"

namespace exl3::engine::cuda {

absl::StatusOr<std::unique_ptr<ResidualStream>> LoadResidualStream(const ModelConfig& cfg, const TensorSource& src,
                                                                   const CudaLinearContext& ctx) {
  if (cfg.dsv4 != nullptr || cfg.glm5next != nullptr) return LoadHyperResidual(cfg, src, ctx.stream);
  if (cfg.qwen4exp != nullptr) return LoadGatedResidual(cfg, src, ctx);
  return LoadPlainResidual(cfg, src, ctx.stream);
}

}  // namespace exl3::engine::cuda
