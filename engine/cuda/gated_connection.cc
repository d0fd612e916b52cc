#include "engine/cuda/gated_connection.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cuda/gated_residual_kernels.h"
#include "engine/cuda/weight_upload.h"

namespace exl3::engine::cuda {

absl::Status GatedConnectionWorkspace::Reserve(const GatedResidualShape& shape, int tokens, bool* moved) {
  const size_t t = static_cast<size_t>(tokens), wide = static_cast<size_t>(shape.streams) * shape.hidden;
  const std::pair<DeviceArray<float>*, size_t> needs[] = {
      {&normed, t * wide}, {&low, t * static_cast<size_t>(shape.lowrank)}, {&weights, t * wide}};
  for (const auto& [array, n] : needs) {
    if (array->size() >= n) continue;
    *moved = true;
    EXL3_RETURN_IF_ERROR(array->Reserve(n));
  }
  return absl::OkStatus();
}

absl::StatusOr<CudaGatedConnection> CudaGatedConnection::Load(const TensorSource& src, const std::string& prefix,
                                                              const GatedResidualShape& shape, bool with_inject) {
  if (shape.hidden < 1 || shape.streams < 1 || shape.lowrank < 1)
    return absl::InvalidArgumentError(absl::StrCat(prefix, ": gated residual of ", shape.streams, " streams of ",
                                                   shape.hidden, ", low rank ", shape.lowrank));
  CudaGatedConnection g;
  g.shape_ = shape;
  const int wide = shape.streams * shape.hidden;
  EXL3_ASSIGN_OR_RETURN(g.norm_weight_,
                        UploadNorm(src, prefix + "hc_norm.weight", wide, NormWeightConvention::kOffsetFromOne));
  EXL3_ASSIGN_OR_RETURN(g.down_, CudaLinear::Load(src, prefix + "input_mix_weight_down", wide, shape.lowrank));
  EXL3_ASSIGN_OR_RETURN(g.up_, CudaLinear::Load(src, prefix + "input_mix_weight_up", shape.lowrank, wide));
  if (with_inject) {
    EXL3_ASSIGN_OR_RETURN(CudaLinear inject,
                          CudaLinear::Load(src, prefix + "block_inject_weight", wide, shape.streams));
    g.inject_ = std::move(inject);
  }
  return g;
}

absl::Status CudaGatedConnection::Collapse(const float* h, const int32_t* rows, int T, GatedConnectionWorkspace& ws,
                                           float* x, float* inject, const CudaLinearContext& ctx) const {
  if (T <= 0) return absl::OkStatus();
  const int S = shape_.streams, H = shape_.hidden;
  const size_t need = static_cast<size_t>(T) * S * H;
  if (ws.normed.size() < need || ws.weights.size() < need ||
      ws.low.size() < static_cast<size_t>(T) * shape_.lowrank)
    return absl::InternalError(absl::StrCat("gated connection: workspace not reserved for ", T, " tokens"));
  if (inject_.has_value() && inject == nullptr)
    return absl::InternalError("gated connection: a block's collapse needs its inject weights' buffer");
  EXL3_RETURN_IF_ERROR(GatedStreamNorm(h, rows, T, S, H, norm_weight_.get(), shape_.eps, ws.normed.get(), ctx.stream));
  // The down and inject projections read the same normed streams: one launch at decode sizes.
  const CudaLinear* projections[2] = {&down_, inject_.has_value() ? &*inject_ : nullptr};
  float* outputs[2] = {ws.low.get(), inject};
  EXL3_RETURN_IF_ERROR(CudaLinear::ForwardShared(projections, inject_.has_value() ? 2 : 1, ws.normed.get(), T, outputs,
                                                 ctx));
  const int64_t n_inject = inject_.has_value() ? static_cast<int64_t>(T) * S : 0;
  EXL3_RETURN_IF_ERROR(
      GatedActivations(ws.low.get(), static_cast<int64_t>(T) * shape_.lowrank, inject, n_inject, S, ctx.stream));
  EXL3_RETURN_IF_ERROR(up_.Forward(ws.low.get(), T, ws.weights.get(), ctx));
  return GatedStreamMix(ws.weights.get(), ws.normed.get(), T, S, H, x, ctx.stream);
}

absl::Status CudaGatedConnection::Expand(const float* inject, const float* out, int T, float* h,
                                         StreamHandle stream) const {
  if (!inject_.has_value()) return absl::InternalError("gated connection: the head's mixer has no expand");
  return GatedExpand(inject, out, T, shape_.streams, shape_.hidden, h, stream);
}

int64_t CudaGatedConnection::weight_bytes() const {
  return down_.weight_bytes() + up_.weight_bytes() + (inject_.has_value() ? inject_->weight_bytes() : 0) +
         static_cast<int64_t>(norm_weight_.size() * sizeof(float));
}

}  // namespace exl3::engine::cuda
