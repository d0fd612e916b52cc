#include "engine/cpu/mtp/mtp_head.h"

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "engine/cpu/attention/load_attention.h"
#include "engine/cpu/rms_norm.h"
#include "kernels/moe_cpu.h"

namespace exl3::engine {
namespace {

// The families whose checkpoints carry the DeepSeek-V3 MTP layer (num_nextn_predict_layers).
bool HasDeepseekMtpDesign(const ModelConfig& cfg) {
  switch (cfg.moe.arch) {
    case Architecture::kDeepseekV3:
    case Architecture::kGlm4Moe:
    case Architecture::kGlmMoeDsa:
    case Architecture::kGlm5Next:
      return true;
    case Architecture::kDeepseekV4:
    case Architecture::kQwen3Moe:
    case Architecture::kQwen3Next:
    case Architecture::kMixtral:
    case Architecture::kQwen4Exp:
      return false;
  }
  return false;
}

bool HasLinear(const TensorSource& src, const std::string& prefix) {
  return src.Has(prefix + ".weight") || src.Has(prefix + ".trellis");
}


}  // namespace

absl::Status MtpHead::CheckPresent(const ModelConfig& cfg, const TensorSource& src) {
  if (!HasDeepseekMtpDesign(cfg)) {
    return absl::FailedPreconditionError(absl::StrCat(
        cfg.architecture(), " has no MTP head of the DeepSeek-V3 design this engine runs (DeepseekV3, "
        "Glm4Moe, GlmMoeDsa, Glm5Next: model.layers.{num_hidden_layers}.eh_proj / enorm / hnorm / "
        "shared_head.norm)"));
  }
  const std::string p = LayerPrefix(cfg.moe, cfg.num_layers);
  std::vector<std::string> missing;
  if (!HasLinear(src, p + "eh_proj")) missing.push_back(p + "eh_proj");
  for (const char* norm : {"enorm.weight", "hnorm.weight", "shared_head.norm.weight", "input_layernorm.weight"})
    if (!src.Has(p + norm)) missing.push_back(p + norm);
  if (!missing.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        cfg.architecture(), " checkpoint has no MTP layer (num_nextn_predict_layers): missing ",
        absl::StrJoin(missing, ", ")));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<MtpHead>> MtpHead::Load(const ModelConfig& model_cfg, const TensorSource& src,
                                                       const Linear& model_head) {
  EXL3_RETURN_IF_ERROR(CheckPresent(model_cfg, src));
  const int n = model_cfg.num_layers, H = model_cfg.hidden_size;
  const std::string p = LayerPrefix(model_cfg.moe, n);
  const bool moe = src.Has(RouterWeightKey(model_cfg.moe, n));
  std::unique_ptr<MtpHead> m(new MtpHead(WithMtpLayer(model_cfg, moe)));
  const ModelConfig& cfg = m->cfg_;
  const NormWeightConvention nw = cfg.norm_weights;
  EXL3_ASSIGN_OR_RETURN(m->enorm_, LoadNormWeight(src, p + "enorm.weight", H, nw));
  EXL3_ASSIGN_OR_RETURN(m->hnorm_, LoadNormWeight(src, p + "hnorm.weight", H, nw));
  EXL3_ASSIGN_OR_RETURN(m->eh_proj_, Linear::Load(src, p + "eh_proj", 2 * H, H));
  EXL3_ASSIGN_OR_RETURN(m->input_norm_, LoadNormWeight(src, p + "input_layernorm.weight", H, nw));
  EXL3_ASSIGN_OR_RETURN(m->post_attention_norm_, LoadNormWeight(src, p + "post_attention_layernorm.weight", H, nw));
  EXL3_ASSIGN_OR_RETURN(m->attention_, LoadAttention(cfg, src, n));
  if (moe) {
    EXL3_ASSIGN_OR_RETURN(MtpMoe block, MtpMoe::Load(cfg, src, n));
    m->moe_.emplace(std::move(block));
  } else {
    const int I = cfg.intermediate_size;
    DenseMlp mlp;
    EXL3_ASSIGN_OR_RETURN(mlp.gate, Linear::Load(src, p + "mlp.gate_proj", H, I));
    EXL3_ASSIGN_OR_RETURN(mlp.up, Linear::Load(src, p + "mlp.up_proj", H, I));
    EXL3_ASSIGN_OR_RETURN(mlp.down, Linear::Load(src, p + "mlp.down_proj", I, H));
    m->dense_mlp_ = std::move(mlp);
  }
  EXL3_ASSIGN_OR_RETURN(m->shared_norm_, LoadNormWeight(src, p + "shared_head.norm.weight", H, nw));
  if (HasLinear(src, p + "shared_head.head")) {
    EXL3_ASSIGN_OR_RETURN(m->own_head_, Linear::Load(src, p + "shared_head.head", H, cfg.vocab_size));
    m->head_ = &*m->own_head_;
  } else {
    m->head_ = &model_head;
  }
  return m;
}

absl::Status MtpHead::Forward(const float* hidden, const float* embedded, const StepTokens& tokens,
                              PagedKvCache& cache, float* out, CpuCompute& compute) {
  const int T = tokens.num_tokens, H = cfg_.hidden_size;
  const float eps = cfg_.rms_norm_eps;
  const size_t n = static_cast<size_t>(T) * H;
  std::vector<float> cat(2 * n);
  for (int t = 0; t < T; ++t) {
    float* row = &cat[static_cast<size_t>(t) * 2 * H];
    RmsNorm(embedded + static_cast<size_t>(t) * H, enorm_.data(), H, eps, row);
    RmsNorm(hidden + static_cast<size_t>(t) * H, hnorm_.data(), H, eps, row + H);
  }
  std::vector<float> h(n), x(n), d(n);
  EXL3_RETURN_IF_ERROR(eh_proj_.Forward(cat.data(), T, h.data(), compute));
  RmsNormRows(h.data(), input_norm_.data(), T, H, eps, x.data());
  AttentionCarry carry;
  EXL3_RETURN_IF_ERROR(attention_->Forward(x.data(), tokens, cache, carry, d.data(), compute));
  for (size_t i = 0; i < n; ++i) h[i] += d[i];
  RmsNormRows(h.data(), post_attention_norm_.data(), T, H, eps, x.data());
  if (moe_.has_value()) {
    EXL3_RETURN_IF_ERROR(moe_->Forward(x.data(), T, d.data(), compute));
  } else {
    const size_t m = static_cast<size_t>(T) * cfg_.intermediate_size;
    std::vector<float> gate(m), up(m);
    EXL3_RETURN_IF_ERROR(dense_mlp_->gate.Forward(x.data(), T, gate.data(), compute));
    EXL3_RETURN_IF_ERROR(dense_mlp_->up.Forward(x.data(), T, up.data(), compute));
    SwiGlu(gate.data(), up.data(), m, cfg_.dense_swiglu_limit);
    EXL3_RETURN_IF_ERROR(dense_mlp_->down.Forward(gate.data(), T, d.data(), compute));
  }
  for (size_t i = 0; i < n; ++i) out[i] = h[i] + d[i];
  return absl::OkStatus();
}

absl::Status MtpHead::Logits(const float* o, int rows, float* logits, CpuCompute& compute) const {
  const int H = cfg_.hidden_size;
  std::vector<float> normed(static_cast<size_t>(rows) * H);
  RmsNormRows(o, shared_norm_.data(), rows, H, cfg_.rms_norm_eps, normed.data());
  return head_->Forward(normed.data(), rows, logits, compute);
}

}  // namespace exl3::engine
