// One of Qwen4-Exp's low-rank gated hyper-connections on the GPU (`attn_hyper_connection`,
// `mlp_hyper_connection`, or `hyper_connection_mixer` before the head): the CPU engine's
// engine/cpu/residual/gated_residual.h (which states the formulas) with its three projections as CudaLinear and
// the rest as engine/cuda/gated_residual_kernels.h. h [tokens, streams, hidden] fp32.
//
//   EXL3_ASSIGN_OR_RETURN(CudaGatedConnection g, CudaGatedConnection::Load(src, prefix, shape, true));
//   EXL3_RETURN_IF_ERROR(ws.Reserve(shape, T, &moved));
//   EXL3_RETURN_IF_ERROR(g.Collapse(h, nullptr, T, ws, x, inject, ctx));   // ... block(x) -> out ...
//   EXL3_RETURN_IF_ERROR(g.Expand(inject, out, T, h, ctx.stream));
#pragma once

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "engine/cuda/cuda_linear.h"
#include "engine/cuda/device_array.h"
#include "engine/cpu/residual/gated_residual.h"
#include "model/safetensors.h"

namespace exl3::engine::cuda {

// What a collapse computes between its launches, for up to `tokens` tokens; every connection of a
// model shares one.
struct GatedConnectionWorkspace {
  DeviceArray<float> normed, low, weights;  // [T, S·H], [T, lowrank], [T, S·H]

  // *moved: whether an address changed.
  absl::Status Reserve(const GatedResidualShape& shape, int tokens, bool* moved);
};

class CudaGatedConnection {
 public:
  // `prefix` ends with '.'; `with_inject`: a block's connection (false: the mixer before the head).
  // The same tensors and checks as GatedResidual::Load.
  static absl::StatusOr<CudaGatedConnection> Load(const TensorSource& src, const std::string& prefix,
                                                  const GatedResidualShape& shape, bool with_inject);

  // x [T, hidden] from the streams of token rows[t] of h (rows [T] int32 on the device, or null for
  // rows 0..T-1); with inject, inject [T, streams] = the expand's weights (else it may be null).
  absl::Status Collapse(const float* h, const int32_t* rows, int num_tokens, GatedConnectionWorkspace& ws, float* x,
                        float* inject, const CudaLinearContext& ctx) const;
  // h_k += inject_k · out for every token and stream; out [T, hidden].
  absl::Status Expand(const float* inject, const float* out, int num_tokens, float* h, StreamHandle stream) const;

  bool with_inject() const { return inject_.has_value(); }
  int64_t weight_bytes() const;

 private:
  GatedResidualShape shape_;
  DeviceArray<float> norm_weight_;  // 1 + w [streams * hidden]
  CudaLinear down_, up_;
  std::optional<CudaLinear> inject_;
};

}  // namespace exl3::engine::cuda
