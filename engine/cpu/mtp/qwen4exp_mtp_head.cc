#include "engine/cpu/mtp/qwen4exp_mtp_head.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "engine/config/qwen4exp_config.h"
#include "engine/cpu/rms_norm.h"

namespace exl3::engine {
namespace {

constexpr char kPrefix[] = "mtp.";
constexpr char kLayer[] = "mtp.layers.0.";

bool HasLinear(const TensorSource& src, const std::string& prefix) {
  return src.Has(prefix + ".weight") || src.Has(prefix + ".trellis");
}


}  // namespace

absl::Status Qwen4ExpMtpHead::CheckPresent(const ModelConfig& cfg, const TensorSource& src) {
  if (cfg.qwen4exp == nullptr)
    return absl::FailedPreconditionError(absl::StrCat(cfg.architecture(), " has no Qwen4-Exp MTP head"));
  const std::string p = kPrefix, l = kLayer;
  std::vector<std::string> missing;
  for (const std::string& norm : {p + "pre_fc_norm_hidden.weight", p + "pre_fc_norm_embedding.weight"})
    if (!src.Has(norm)) missing.push_back(norm);
  for (const std::string& linear : {p + "fc_hidden", p + "fc_embedding", l + "self_attn.q_proj"})
    if (!HasLinear(src, linear)) missing.push_back(linear);
  for (const std::string& t : {l + "attn_hyper_connection.hc_norm.weight", l + "mlp.gate.weight",
                               p + "hyper_connection_mixer.hc_norm.weight"})
    if (!src.Has(t)) missing.push_back(t);
  if (!missing.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        cfg.architecture(), " checkpoint has no MTP head of the Qwen4-Exp design (mtp.*): missing ",
        absl::StrJoin(missing, ", ")));
  }
  if (HasLinear(src, "mtp.layers.1.self_attn.q_proj"))
    return absl::FailedPreconditionError(absl::StrCat(
        cfg.architecture(), ": an MTP head of more than one layer (mtp.layers.1.*) is not run"));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Qwen4ExpMtpHead>> Qwen4ExpMtpHead::Load(const ModelConfig& model_cfg,
                                                                       const TensorSource& src,
                                                                       const Linear& model_head) {
  EXL3_RETURN_IF_ERROR(CheckPresent(model_cfg, src));
  const Qwen4ExpConfig& q = *model_cfg.qwen4exp;
  const int n = model_cfg.num_layers, H = model_cfg.hidden_size, S = q.hc_count;
  std::unique_ptr<Qwen4ExpMtpHead> m(new Qwen4ExpMtpHead(WithMtpLayer(model_cfg, /*moe=*/true), S));
  const ModelConfig& cfg = m->cfg_;
  const std::string p = kPrefix, l = kLayer;
  const NormWeightConvention zc = NormWeightConvention::kOffsetFromOne;
  EXL3_ASSIGN_OR_RETURN(m->hidden_norm_, LoadNormWeight(src, p + "pre_fc_norm_hidden.weight", S * H, zc));
  EXL3_ASSIGN_OR_RETURN(m->embedding_norm_, LoadNormWeight(src, p + "pre_fc_norm_embedding.weight", H, zc));
  EXL3_ASSIGN_OR_RETURN(m->fc_hidden_, Linear::Load(src, p + "fc_hidden", H, H));
  EXL3_ASSIGN_OR_RETURN(m->fc_embedding_, Linear::Load(src, p + "fc_embedding", H, H));
  const GatedResidualShape shape{H, S, q.hc_lowrank, cfg.rms_norm_eps};
  EXL3_ASSIGN_OR_RETURN(m->attn_gr_, GatedResidual::Load(src, l + "attn_hyper_connection.", shape, true));
  EXL3_ASSIGN_OR_RETURN(m->ffn_gr_, GatedResidual::Load(src, l + "mlp_hyper_connection.", shape, true));
  EXL3_ASSIGN_OR_RETURN(m->mixer_, GatedResidual::Load(src, p + "hyper_connection_mixer.", shape, false));
  EXL3_ASSIGN_OR_RETURN(m->attention_, QsaAttention::Load(cfg, src, n, l));
  EXL3_ASSIGN_OR_RETURN(MtpMoe moe, MtpMoe::Load(cfg, src, n, l));
  m->moe_.emplace(std::move(moe));
  m->head_ = &model_head;
  return m;
}

absl::Status Qwen4ExpMtpHead::Forward(const float* hidden, const float* embedded, const StepTokens& tokens,
                                      PagedKvCache& cache, float* out, CpuCompute& compute) {
  const int T = tokens.num_tokens, H = cfg_.hidden_size, S = streams_;
  const float eps = cfg_.rms_norm_eps;
  const size_t n = static_cast<size_t>(T) * H, wide = n * S;
  // The streams: fc_hidden of each normed model stream, plus the embedding branch in every one.
  std::vector<float> normed(wide), from_hidden(wide), e(n), from_embedding(n);
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < S; ++k) {
      const size_t row = (static_cast<size_t>(t) * S + k) * H;
      RmsNorm(hidden + row, &hidden_norm_[static_cast<size_t>(k) * H], H, eps, &normed[row]);
    }
  EXL3_RETURN_IF_ERROR(fc_hidden_.Forward(normed.data(), T * S, from_hidden.data(), compute));
  RmsNormRows(embedded, embedding_norm_.data(), T, H, eps, e.data());
  EXL3_RETURN_IF_ERROR(fc_embedding_.Forward(e.data(), T, from_embedding.data(), compute));
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < S; ++k)
      for (int i = 0; i < H; ++i) {
        const size_t at = (static_cast<size_t>(t) * S + k) * H + i;
        out[at] = from_hidden[at] + from_embedding[static_cast<size_t>(t) * H + i];
      }
  // The block around its gated residual connections, on `out` in place.
  std::vector<float> x(n), d(n), inject;
  AttentionCarry carry;
  EXL3_RETURN_IF_ERROR(attn_gr_->Collapse(out, T, x.data(), &inject, compute));
  EXL3_RETURN_IF_ERROR(attention_->Forward(x.data(), tokens, cache, carry, d.data(), compute));
  attn_gr_->Expand(inject, d.data(), T, out);
  EXL3_RETURN_IF_ERROR(ffn_gr_->Collapse(out, T, x.data(), &inject, compute));
  EXL3_RETURN_IF_ERROR(moe_->Forward(x.data(), T, d.data(), compute));
  ffn_gr_->Expand(inject, d.data(), T, out);
  return absl::OkStatus();
}

absl::Status Qwen4ExpMtpHead::Logits(const float* o, int rows, float* logits, CpuCompute& compute) const {
  std::vector<float> mixed(static_cast<size_t>(rows) * cfg_.hidden_size);
  EXL3_RETURN_IF_ERROR(mixer_->Collapse(o, rows, mixed.data(), nullptr, compute));
  return head_->Forward(mixed.data(), rows, logits, compute);
}

}  // namespace exl3::engine
