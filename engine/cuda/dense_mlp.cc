#include "engine/cuda/dense_mlp.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cuda/engine_kernels.h"

namespace exl3::engine::cuda {

absl::StatusOr<CudaDenseMlp> CudaDenseMlp::Load(const TensorSource& src, const std::string& prefix, int hidden,
                                                int intermediate, float swiglu_limit) {
  if (!(swiglu_limit >= 0.0f) || !std::isfinite(swiglu_limit))
    return absl::InvalidArgumentError(absl::StrCat(prefix, ": swiglu limit ", swiglu_limit, " (must be finite, >= 0)"));
  CudaDenseMlp mlp;
  mlp.swiglu_limit_ = swiglu_limit;
  EXL3_ASSIGN_OR_RETURN(mlp.gate_, CudaLinear::Load(src, prefix + "gate_proj", hidden, intermediate));
  EXL3_ASSIGN_OR_RETURN(mlp.up_, CudaLinear::Load(src, prefix + "up_proj", hidden, intermediate));
  EXL3_ASSIGN_OR_RETURN(mlp.down_, CudaLinear::Load(src, prefix + "down_proj", intermediate, hidden));
  return mlp;
}

absl::Status CudaDenseMlp::Forward(const float* x, int n, float* gate, float* up, float* out,
                                   const CudaLinearContext& ctx) const {
  EXL3_RETURN_IF_ERROR(gate_.Forward(x, n, gate, ctx));
  EXL3_RETURN_IF_ERROR(up_.Forward(x, n, up, ctx));
  const int64_t elements = static_cast<int64_t>(n) * gate_.out_features();
  EXL3_RETURN_IF_ERROR(swiglu_limit_ > 0.0f ? ClampedSiluMul(gate, up, elements, swiglu_limit_, ctx.stream)
                                            : SiluMul(gate, up, elements, ctx.stream));
  return down_.Forward(gate, n, out, ctx);
}

}  // namespace exl3::engine::cuda
