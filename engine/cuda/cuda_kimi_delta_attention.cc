#include "engine/cuda/cuda_kimi_delta_attention.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/config/glm5next_config.h"
#include "engine/cpu/linear_attention/kimi_delta_attention.h"
#include "engine/cpu/linear.h"
#include "model/moe_config.h"

namespace exl3::engine::cuda {

absl::Status KdaWorkspace::Reserve(const LinearAttentionConfig& s, int rows, bool* moved) {
  const size_t t = static_cast<size_t>(rows);
  const size_t W = static_cast<size_t>(s.num_key_heads) * s.key_head_dim;
  struct Need {
    DeviceArray<float>* a;
    size_t n;
  };
  const Need needs[] = {{&q, t * W},
                        {&k, t * W},
                        {&v, t * W},
                        {&f_low, t * s.key_head_dim},
                        {&g_low, t * s.key_head_dim},
                        {&log_decay, t * W},
                        {&gate, t * W},
                        {&beta, t * s.num_key_heads},
                        {&conv_out, t * 3 * W},
                        {&core, t * W}};
  for (const Need& n : needs) {
    if (n.a->size() >= n.n) continue;
    *moved = true;
    EXL3_RETURN_IF_ERROR(n.a->Reserve(n.n));
  }
  return absl::OkStatus();
}

CudaKimiDeltaAttention::CudaKimiDeltaAttention(const ModelConfig& cfg, int64_t state_offset)
    : eps_(cfg.rms_norm_eps), hidden_(cfg.hidden_size), state_offset_(state_offset) {
  const LinearAttentionConfig& s = cfg.linear_attention;
  dims_ = KdaDims{s.num_key_heads, s.key_head_dim, s.conv_kernel};
}

absl::StatusOr<std::unique_ptr<CudaKimiDeltaAttention>> CudaKimiDeltaAttention::Load(
    const ModelConfig& cfg, const TensorSource& src, int layer, int64_t state_offset) {
  if (cfg.glm5next == nullptr)
    return absl::InvalidArgumentError("KDA layers are GLM-5.3-Flash's; this config is not one");
  const LinearAttentionConfig& s = cfg.linear_attention;
  if (s.num_value_heads != s.num_key_heads || s.value_head_dim != s.key_head_dim)
    return absl::InvalidArgumentError(absl::StrCat("KDA: q, k and v have the same heads; got ",
                                                   s.num_key_heads, " x ", s.key_head_dim, " keys and ",
                                                   s.num_value_heads, " x ", s.value_head_dim, " values"));
  std::unique_ptr<CudaKimiDeltaAttention> a(new CudaKimiDeltaAttention(cfg, state_offset));
  if (cfg.glm5next->gate_lower_bound.has_value()) {
    a->gate_ = KdaForgetGate{KdaForgetGate::Form::kLowerBounded, *cfg.glm5next->gate_lower_bound};
  } else {
    a->gate_ = KdaForgetGate{KdaForgetGate::Form::kSoftplus, 0.0f};
  }
  EXL3_RETURN_IF_ERROR(CheckKdaDims(a->dims_));
  // The CPU layer's weights (engine/cpu/linear_attention/kimi_delta_attention.h KdaWeights), uploaded.
  EXL3_ASSIGN_OR_RETURN(const KdaWeights w, KdaWeights::Load(cfg, src, layer));
  const std::pair<CudaLinear*, const Linear*> linears[] = {{&a->q_, &w.q},     {&a->k_, &w.k},     {&a->v_, &w.v},
                                                           {&a->f_a_, &w.f_a}, {&a->f_b_, &w.f_b}, {&a->b_, &w.b},
                                                           {&a->g_a_, &w.g_a}, {&a->g_b_, &w.g_b}, {&a->o_, &w.o}};
  for (const auto& [device, host] : linears) {
    EXL3_ASSIGN_OR_RETURN(*device, CudaLinear::Upload(*host));
  }
  EXL3_RETURN_IF_ERROR(a->conv_weight_.Upload(w.conv_weight));
  EXL3_RETURN_IF_ERROR(a->decay_rate_.Upload(w.decay_rate));
  EXL3_RETURN_IF_ERROR(a->dt_bias_.Upload(w.dt_bias));
  EXL3_RETURN_IF_ERROR(a->o_norm_.Upload(w.o_norm));
  return a;
}

int64_t CudaKimiDeltaAttention::weight_bytes() const {
  int64_t bytes = static_cast<int64_t>(conv_weight_.size() * sizeof(float));
  for (const CudaLinear* l : linears()) bytes += l->weight_bytes();
  return bytes;
}

absl::Status CudaKimiDeltaAttention::Forward(const float* x, int first, int n,
                                             const RecurrentStep& step, KdaWorkspace& ws,
                                             const CudaLinearContext& ctx, float* out) const {
  if (n <= 0) return absl::OkStatus();
  const size_t r = static_cast<size_t>(first);
  const int D = dims_.head_dim, W = dims_.width(), NH = dims_.num_heads;
  const float* xr = x + r * hidden_;
  const CudaLinear* qkv[3] = {&q_, &k_, &v_};
  float* const qkv_out[3] = {ws.q.get() + r * W, ws.k.get() + r * W, ws.v.get() + r * W};
  EXL3_RETURN_IF_ERROR(CudaLinear::ForwardShared(qkv, 3, xr, n, qkv_out, ctx));
  const CudaLinear* low[3] = {&f_a_, &g_a_, &b_};
  float* const low_out[3] = {ws.f_low.get() + r * D, ws.g_low.get() + r * D, ws.beta.get() + r * NH};
  EXL3_RETURN_IF_ERROR(CudaLinear::ForwardShared(low, 3, xr, n, low_out, ctx));
  const CudaLinear* up[2] = {&f_b_, &g_b_};
  const float* const up_in[2] = {ws.f_low.get() + r * D, ws.g_low.get() + r * D};
  float* const up_out[2] = {ws.log_decay.get() + r * W, ws.gate.get() + r * W};
  EXL3_RETURN_IF_ERROR(CudaLinear::ForwardEach(up, up_in, 2, n, up_out, ctx));

  RecurrentChunks chunks = step.chunks;
  chunks.states = step.store + state_offset_;
  EXL3_RETURN_IF_ERROR(KdaConv(ws.q.get(), ws.k.get(), ws.v.get(), conv_weight_.get(), dims_, chunks,
                               first, n, ws.conv_out.get(), ctx.stream));
  EXL3_RETURN_IF_ERROR(KdaConvState(ws.q.get(), ws.k.get(), ws.v.get(), dims_, chunks,
                                    step.first_chunk, step.num_chunks, ctx.stream));
  EXL3_RETURN_IF_ERROR(KdaNormAndGates(ws.conv_out.get(), ws.log_decay.get(), ws.beta.get(),
                                       decay_rate_.get(), dt_bias_.get(), gate_, dims_, first, n,
                                       ctx.stream));
  EXL3_RETURN_IF_ERROR(KdaRecurrence(ws.conv_out.get(), ws.log_decay.get(), ws.beta.get(), dims_,
                                     chunks, step.first_chunk, step.num_chunks, ws.core.get(),
                                     ctx.stream));
  EXL3_RETURN_IF_ERROR(KdaGatedNorm(ws.core.get(), ws.gate.get(), o_norm_.get(), dims_, eps_, first,
                                    n, ctx.stream));
  return o_.Forward(ws.core.get() + r * W, n, out + r * hidden_, ctx);
}

}  // namespace exl3::engine::cuda
