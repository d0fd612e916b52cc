#include "engine/cuda/load_cuda_mtp_drafter.h"

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cpu/mtp/load_mtp_drafter.h"
#include "engine/cuda/cuda_mtp_head.h"
#include "engine/cuda/cuda_qwen4exp_mtp_head.h"

namespace exl3::engine::cuda {

absl::Status CheckCudaMtpDrafter(const ModelConfig& cfg, const TensorSource& src) {
  // DeepSeek-V4's DSPARK block drafter (docs/dspark.md) runs on the CPU engine only so far.
  if (cfg.dsv4 != nullptr)
    return absl::FailedPreconditionError(absl::StrCat(
        cfg.architecture(), "'s MTP component (mtp.*: the DSPARK block drafter) is not run by the GPU "
        "engine; use the CPU engine or --speculative-method ngram"));
  // The same designs as the CPU engine's: the design and its tensors, by name.
  return CheckMtpDrafter(cfg, src);
}

absl::StatusOr<std::unique_ptr<CudaMtpDrafter>> LoadCudaMtpDrafter(const ModelConfig& cfg, const TensorSource& src,
                                                                   const CudaMtpModelParts& parts) {
  EXL3_RETURN_IF_ERROR(CheckCudaMtpDrafter(cfg, src));
  if (cfg.qwen4exp != nullptr) {
    EXL3_ASSIGN_OR_RETURN(std::unique_ptr<CudaQwen4ExpMtpHead> head, CudaQwen4ExpMtpHead::Load(cfg, src, parts));
    return std::unique_ptr<CudaMtpDrafter>(std::move(head));
  }
  EXL3_ASSIGN_OR_RETURN(std::unique_ptr<CudaMtpHead> head, CudaMtpHead::Load(cfg, src, parts));
  return std::unique_ptr<CudaMtpDrafter>(std::move(head));
}

}  // namespace exl3::engine::cuda
