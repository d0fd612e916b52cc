#include "engine/cuda/cuda_ple_layer.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cuda/gated_residual_kernels.h"
#include "engine/cuda/recurrent_layer_states.h"
#include "engine/cuda/weight_upload.h"
#include "engine/config/qwen4exp_config.h"
#include "model/moe_config.h"

namespace exl3::engine::cuda {

absl::Status PleWorkspace::Reserve(const PleShape& shape, int rows, bool* moved) {
  const size_t t = static_cast<size_t>(rows), wide = static_cast<size_t>(shape.wide());
  const std::pair<DeviceArray<float>*, size_t> needs[] = {
      {&key, t * wide}, {&query, t * wide}, {&v, t * wide}, {&normed, t * wide}, {&value, t * shape.hidden}};
  for (const auto& [array, n] : needs) {
    if (array->size() >= n) continue;
    *moved = true;
    EXL3_RETURN_IF_ERROR(array->Reserve(n));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<CudaPleLayer>> CudaPleLayer::Load(const ModelConfig& cfg, const TensorSource& src,
                                                                 int layer) {
  std::unique_ptr<CudaPleLayer> p(new CudaPleLayer());
  // The host layer checks the table, the hashing buffers and every tensor's shape.
  EXL3_ASSIGN_OR_RETURN(p->host_, PleLayer::Load(cfg, src, layer));
  const Qwen4ExpConfig& q = *cfg.qwen4exp;
  const PleConfig& ple = q.ple;
  const int H = cfg.hidden_size, wide = q.hc_count * H;
  p->shape_ = PleShape{q.hc_count, H, ple.conv_kernel, ple.ngram_size};
  p->embed_dim_ = ple.embed_dim;
  p->eps_ = cfg.rms_norm_eps;
  p->state_offset_ = RecurrentLayerStates::StateOffset(cfg, layer) + cfg.linear_attention.ConvStateFloats() +
                     cfg.linear_attention.RecurrentStateFloats() + ple.context_tokens();
  const std::string prefix = LayerPrefix(cfg.moe, layer) + "ple.";
  EXL3_ASSIGN_OR_RETURN(p->key_, CudaLinear::Load(src, prefix + "key_proj", ple.embed_dim, wide));
  EXL3_ASSIGN_OR_RETURN(p->value_, CudaLinear::Load(src, prefix + "value_proj", ple.embed_dim, H));
  const NormWeightConvention zc = NormWeightConvention::kOffsetFromOne;
  EXL3_ASSIGN_OR_RETURN(p->norm_key_, UploadNorm(src, prefix + "norm_key.weight", wide, zc));
  EXL3_ASSIGN_OR_RETURN(p->norm_query_, UploadNorm(src, prefix + "norm_query.weight", wide, zc));
  EXL3_ASSIGN_OR_RETURN(p->norm_conv_, UploadNorm(src, prefix + "norm_conv.weight", wide, zc));
  EXL3_ASSIGN_OR_RETURN(TensorView cw, src.Get(prefix + "conv1d.weight"));  // [wide, 1, K], checked above
  EXL3_ASSIGN_OR_RETURN(std::vector<float> conv, ToFloat32(cw));
  EXL3_RETURN_IF_ERROR(p->conv_weight_.Upload(conv));
  return p;
}

absl::Status CudaPleLayer::Forward(float* h, const float* e, int first, int n, const RecurrentStep& step,
                                   PleWorkspace& ws, const CudaLinearContext& ctx) const {
  if (n <= 0) return absl::OkStatus();
  const int S = shape_.streams, H = shape_.hidden;
  const size_t r = static_cast<size_t>(first), wide = static_cast<size_t>(shape_.wide());
  float* key = ws.key.get() + r * wide;
  const CudaLinear* in[2] = {&key_, &value_};
  float* const out[2] = {key, ws.value.get() + r * H};
  EXL3_RETURN_IF_ERROR(CudaLinear::ForwardShared(in, 2, e + r * embed_dim_, n, out, ctx));
  EXL3_RETURN_IF_ERROR(GatedStreamNorm(key, nullptr, n, S, H, norm_key_.get(), eps_, key, ctx.stream));
  EXL3_RETURN_IF_ERROR(
      GatedStreamNorm(h + r * wide, nullptr, n, S, H, norm_query_.get(), eps_, ws.query.get() + r * wide, ctx.stream));
  EXL3_RETURN_IF_ERROR(PleGate(ws.key.get(), ws.query.get(), ws.value.get(), shape_, first, n, ws.v.get(), ctx.stream));
  EXL3_RETURN_IF_ERROR(GatedStreamNorm(ws.v.get() + r * wide, nullptr, n, S, H, norm_conv_.get(), eps_,
                                       ws.normed.get() + r * wide, ctx.stream));
  RecurrentChunks chunks = step.chunks;
  chunks.states = step.store + state_offset_;
  EXL3_RETURN_IF_ERROR(PleConv(ws.v.get(), ws.normed.get(), conv_weight_.get(), shape_, chunks, first, n, h, ctx.stream));
  return PleConvState(ws.normed.get(), shape_, chunks, step.first_chunk, step.num_chunks, ctx.stream);
}

}  // namespace exl3::engine::cuda
