#include "engine/cpu/mtp/load_mtp_drafter.h"

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/config/dsv4_config.h"
#include "engine/cpu/mtp/mtp_head.h"
#include "engine/cpu/mtp/qwen4exp_mtp_head.h"

namespace exl3::engine {

absl::Status CheckMtpDrafter(const ModelConfig& cfg, const TensorSource& src) {
  if (cfg.dsv4 != nullptr) {
    // Not a next-token MTP layer: DeepSeek-V4's mtp.* blocks are the DSPARK block drafter
    // (docs/dspark.md; engine/cpu/mtp/dspark_drafter.h), run by the CPU model itself.
    const Dsv4DsparkConfig& d = cfg.dsv4->dspark;
    if (!d.enabled())
      return absl::FailedPreconditionError(absl::StrCat(
          cfg.architecture(), "'s config.json names no DSPARK mtp drafter (compress_ratios past "
          "num_hidden_layers: ", d.num_blocks, " blocks, dspark_block_size ", d.block_size,
          ", dspark_target_layer_ids: ", d.num_taps(), "); use --speculative-method ngram"));
    if (!src.Has("mtp.0.attn.wkv.weight") && !src.Has("mtp.0.attn.wkv.trellis"))
      return absl::FailedPreconditionError(absl::StrCat(
          cfg.architecture(), ": the checkpoint has no mtp.* tensors (mtp.0.attn.wkv) for its DSPARK "
          "drafter; use --speculative-method ngram"));
    return absl::OkStatus();
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
