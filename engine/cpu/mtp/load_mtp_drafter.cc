#include "engine/cpu/mtp/load_mtp_drafter.h"

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cpu/mtp/mtp_head.h"
#include "engine/cpu/mtp/qwen4exp_mtp_head.h"

namespace exl3::engine {

absl::Status CheckMtpDrafter(const ModelConfig& cfg, const TensorSource& src) {
  if (cfg.dsv4 != nullptr) {
    // Not a next-token MTP layer: DeepSeek-V4's mtp.* blocks draft a whole block of tokens at
    // once from several layers' hidden states (docs/dspark.md states what they compute; the
    // fixture tests/fixtures/engine/deepseek_v4_release_mtp holds reference drafts).
    return absl::FailedPreconditionError(absl::StrCat(
        cfg.architecture(), "'s MTP component (mtp.*: a block drafter over several layers' hidden "
        "states) is not run by this engine; use --speculative-method ngram"));
  }
  if (cfg.qwen4exp != nullptr) return Qwen4ExpMtpHead::CheckPresent(cfg, src);
  return MtpHead::CheckPresent(cfg, src);
}

absl::StatusOr<std::unique_ptr<MtpDrafter>> LoadMtpDrafter(const ModelConfig& cfg, const TensorSource& src,
                                                           const Linear& model_head) {
  if (cfg.qwen4exp != nullptr) {
    EXL3_ASSIGN_OR_RETURN(std::unique_ptr<Qwen4ExpMtpHead> h, Qwen4ExpMtpHead::Load(cfg, src, model_head));
    return std::unique_ptr<MtpDrafter>(std::move(h));
  }
  EXL3_ASSIGN_OR_RETURN(std::unique_ptr<MtpHead> h, MtpHead::Load(cfg, src, model_head));
  return std::unique_ptr<MtpDrafter>(std::move(h));
}

}  // namespace exl3::engine
