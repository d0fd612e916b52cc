#include "engine/cuda/cuda_mtp_drafter.h"

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cpu/mtp/load_mtp_drafter.h"
#include "engine/cuda/cuda_mtp_head.h"

namespace exl3::engine::cuda {

absl::Status CheckCudaMtpDrafter(const ModelConfig& cfg, const TensorSource& src) {
  EXL3_RETURN_IF_ERROR(CheckMtpDrafter(cfg, src));  // the design and its tensors, by name
  if (cfg.qwen4exp != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        cfg.architecture(), "'s MTP head (mtp.*, over the hyper-connection streams) does not run on the GPU "
        "engine yet; run it on the CPU engine (--engine-device cpu) or use --speculative-method ngram"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<CudaMtpDrafter>> LoadCudaMtpDrafter(const ModelConfig& cfg, const TensorSource& src,
                                                                   const CudaMtpModelParts& parts) {
  EXL3_RETURN_IF_ERROR(CheckCudaMtpDrafter(cfg, src));
  EXL3_ASSIGN_OR_RETURN(std::unique_ptr<CudaMtpHead> head, CudaMtpHead::Load(cfg, src, parts));
  return std::unique_ptr<CudaMtpDrafter>(std::move(head));
}

}  // namespace exl3::engine::cuda
