#include "engine/cuda/cuda_gated_deltanet.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cpu/linear.h"
#include "engine/config/qwen4exp_config.h"
#include "model/moe_config.h"

namespace exl3::engine::cuda {

absl::Status DeltaNetWorkspace::Reserve(const LinearAttentionConfig& s, int T, bool* moved) {
  const size_t t = static_cast<size_t>(T);
  struct Need {
    DeviceArray<float>* a;
    size_t n;
  };
  const Need needs[] = {{&qkvz, t * (2 * s.key_dim() + 2 * s.value_dim())},
                        {&ba, t * 2 * s.num_value_heads},
                        {&conv_out, t * s.conv_channels()},
                        {&beta, t * s.num_value_heads},
                        {&decay, t * s.num_value_heads},
                        {&core, t * s.value_dim()}};
  for (const Need& n : needs) {
    if (n.a->size() >= n.n) continue;
    *moved = true;
    EXL3_RETURN_IF_ERROR(n.a->Reserve(n.n));
  }
  return absl::OkStatus();
}

CudaGatedDeltaNet::CudaGatedDeltaNet(const ModelConfig& cfg, int64_t state_offset)
    : eps_(cfg.rms_norm_eps), hidden_(cfg.hidden_size), state_offset_(state_offset) {
  const LinearAttentionConfig& s = cfg.linear_attention;
  dims_ = DeltaNetDims{s.num_key_heads, s.num_value_heads, s.key_head_dim, s.value_head_dim,
                       s.conv_kernel};
}

absl::StatusOr<std::unique_ptr<CudaGatedDeltaNet>> CudaGatedDeltaNet::Load(const ModelConfig& cfg,
                                                                           const TensorSource& src,
                                                                           int layer,
                                                                           int64_t state_offset) {
  std::unique_ptr<CudaGatedDeltaNet> d(new CudaGatedDeltaNet(cfg, state_offset));
  const LinearAttentionConfig& s = cfg.linear_attention;
  EXL3_RETURN_IF_ERROR(CheckDeltaNetDims(d->dims_));
  const std::string p = LayerPrefix(cfg.moe, layer) + "linear_attn.";
  const int H = cfg.hidden_size;
  if (cfg.qwen4exp != nullptr) {
    d->layout_ = ProjectionLayout::kSeparate;
    switch (cfg.qwen4exp->output_gate) {
      case OutputGateActivation::kSilu: d->gate_ = DeltaNetOutputGate::kSilu; break;
      case OutputGateActivation::kSigmoid: d->gate_ = DeltaNetOutputGate::kSigmoid; break;
    }
    EXL3_ASSIGN_OR_RETURN(d->qkv_, CudaLinear::Load(src, p + "in_proj_qkv", H, s.conv_channels()));
    EXL3_ASSIGN_OR_RETURN(d->z_, CudaLinear::Load(src, p + "in_proj_z", H, s.value_dim()));
    EXL3_ASSIGN_OR_RETURN(d->b_, CudaLinear::Load(src, p + "in_proj_b", H, s.num_value_heads));
    EXL3_ASSIGN_OR_RETURN(d->a_, CudaLinear::Load(src, p + "in_proj_a", H, s.num_value_heads));
  } else {
    EXL3_ASSIGN_OR_RETURN(d->qkvz_, CudaLinear::Load(src, p + "in_proj_qkvz", H, d->dims_.qkvz_width()));
    EXL3_ASSIGN_OR_RETURN(d->ba_, CudaLinear::Load(src, p + "in_proj_ba", H, 2 * s.num_value_heads));
  }
  EXL3_ASSIGN_OR_RETURN(d->out_, CudaLinear::Load(src, p + "out_proj", s.value_dim(), H));

  const std::string conv = p + "conv1d.weight";
  EXL3_ASSIGN_OR_RETURN(TensorView cw, src.Get(conv));
  const std::vector<int64_t> want = {s.conv_channels(), 1, s.conv_kernel};
  if (cw.info->shape != want)
    return absl::InvalidArgumentError(
        absl::StrCat(conv, ": expected shape [", s.conv_channels(), ", 1, ", s.conv_kernel, "]"));
  if (src.Has(p + "conv1d.bias"))
    return absl::InvalidArgumentError(absl::StrCat(
        p, "conv1d.bias: Qwen3-Next's convolution has no bias; this checkpoint is not one"));
  EXL3_ASSIGN_OR_RETURN(std::vector<float> conv_weight, ToFloat32(cw));
  EXL3_RETURN_IF_ERROR(d->conv_weight_.Upload(conv_weight));
  EXL3_ASSIGN_OR_RETURN(std::vector<float> a_log, LoadVector(src, p + "A_log", s.num_value_heads));
  std::vector<float> neg_a;
  for (float v : a_log) neg_a.push_back(-std::exp(v));
  EXL3_RETURN_IF_ERROR(d->neg_a_.Upload(neg_a));
  EXL3_ASSIGN_OR_RETURN(std::vector<float> dt_bias,
                        LoadVector(src, p + "dt_bias", s.num_value_heads));
  EXL3_RETURN_IF_ERROR(d->dt_bias_.Upload(dt_bias));
  // The gated norm's weight is used as stored (not zero-centred), as the CPU layer does.
  EXL3_ASSIGN_OR_RETURN(std::vector<float> norm,
                        LoadVector(src, p + "norm.weight", s.value_head_dim));
  EXL3_RETURN_IF_ERROR(d->norm_weight_.Upload(norm));
  return d;
}

std::vector<const CudaLinear*> CudaGatedDeltaNet::linears() const {
  switch (layout_) {
    case ProjectionLayout::kFusedPerKeyHead: return {&qkvz_, &ba_, &out_};
    case ProjectionLayout::kSeparate: return {&qkv_, &z_, &b_, &a_, &out_};
  }
  return {};
}

int64_t CudaGatedDeltaNet::weight_bytes() const {
  int64_t bytes = static_cast<int64_t>(conv_weight_.size() * sizeof(float));
  for (const CudaLinear* l : linears()) bytes += l->weight_bytes();
  return bytes;
}

absl::Status CudaGatedDeltaNet::Project(const float* x, int first, int n, DeltaNetWorkspace& ws,
                                        const CudaLinearContext& ctx) const {
  const size_t r = static_cast<size_t>(first);
  const int NV = dims_.num_value_heads;
  float* qkvz = ws.qkvz.get() + r * dims_.qkvz_width();
  float* ba = ws.ba.get() + r * 2 * NV;
  if (layout_ == ProjectionLayout::kFusedPerKeyHead) {
    const CudaLinear* in[2] = {&qkvz_, &ba_};
    float* const in_out[2] = {qkvz, ba};
    return CudaLinear::ForwardShared(in, 2, x + r * hidden_, n, in_out, ctx);
  }
  // The separate projections land in the rows of buffers the later kernels overwrite, whose shapes
  // are theirs (conv_out [T, conv_channels] for qkv, core [T, value_dim] for z, beta and decay
  // [T, NV] for b and a), so the layout needs no memory of its own; then regrouped into qkvz, ba.
  float* qkv = ws.conv_out.get() + r * dims_.conv_channels();
  float* z = ws.core.get() + r * dims_.value_dim();
  float* b = ws.beta.get() + r * NV;
  float* a = ws.decay.get() + r * NV;
  const CudaLinear* in[4] = {&qkv_, &z_, &b_, &a_};
  float* const in_out[4] = {qkv, z, b, a};
  EXL3_RETURN_IF_ERROR(CudaLinear::ForwardShared(in, 4, x + r * hidden_, n, in_out, ctx));
  return DeltaNetGroupSeparateProjections(ws.conv_out.get(), ws.core.get(), ws.beta.get(), ws.decay.get(), dims_,
                                          first, n, ws.qkvz.get(), ws.ba.get(), ctx.stream);
}

absl::Status CudaGatedDeltaNet::Forward(const float* x, int first, int n, const RecurrentStep& step,
                                        DeltaNetWorkspace& ws, const CudaLinearContext& ctx,
                                        float* out) const {
  if (n <= 0) return absl::OkStatus();
  const size_t r = static_cast<size_t>(first);
  float* qkvz = ws.qkvz.get();
  float* ba = ws.ba.get();
  EXL3_RETURN_IF_ERROR(Project(x, first, n, ws, ctx));
  RecurrentChunks chunks = step.chunks;
  chunks.states = step.store + state_offset_;
  EXL3_RETURN_IF_ERROR(DeltaNetConv(qkvz, conv_weight_.get(), dims_, chunks, first, n,
                                    ws.conv_out.get(), ctx.stream));
  EXL3_RETURN_IF_ERROR(
      DeltaNetConvState(qkvz, dims_, chunks, step.first_chunk, step.num_chunks, ctx.stream));
  EXL3_RETURN_IF_ERROR(DeltaNetNormAndGates(ws.conv_out.get(), ba, neg_a_.get(), dt_bias_.get(),
                                            dims_, first, n, ws.beta.get(), ws.decay.get(),
                                            ctx.stream));
  EXL3_RETURN_IF_ERROR(DeltaNetRecurrence(ws.conv_out.get(), ws.beta.get(), ws.decay.get(), dims_,
                                          chunks, step.first_chunk, step.num_chunks, ws.core.get(),
                                          ctx.stream));
  EXL3_RETURN_IF_ERROR(DeltaNetGatedNorm(ws.core.get(), qkvz, norm_weight_.get(), dims_, eps_, gate_,
                                         first, n, ctx.stream));
  return out_.Forward(ws.core.get() + r * dims_.value_dim(), n, out + r * hidden_, ctx);
}

}  // namespace exl3::engine::cuda
