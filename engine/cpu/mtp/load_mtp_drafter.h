// The MTP drafter of a model's family (engine/cpu/mtp/mtp_drafter.h): the factory over the designs
// (engine/cpu/mtp/mtp_head.h, engine/cpu/mtp/qwen4exp_mtp_head.h), apart from the interface they implement.
//
//   EXL3_RETURN_IF_ERROR(CheckMtpDrafter(cfg, src));
//   EXL3_ASSIGN_OR_RETURN(std::unique_ptr<MtpDrafter> d, LoadMtpDrafter(cfg, src, lm_head));
#pragma once

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/cpu/linear.h"
#include "engine/config/model_config.h"
#include "engine/cpu/mtp/mtp_drafter.h"
#include "model/safetensors.h"

namespace exl3::engine {

// OK when `cfg`'s family has an MTP design this engine runs and `src` holds its layer; else
// FAILED_PRECONDITION naming the architecture and what is missing.
absl::Status CheckMtpDrafter(const ModelConfig& cfg, const TensorSource& src);
// The design's drafter; `model_head` (the model's lm_head) must outlive it.
absl::StatusOr<std::unique_ptr<MtpDrafter>> LoadMtpDrafter(const ModelConfig& cfg, const TensorSource& src,
                                                           const Linear& model_head);

}  // namespace exl3::engine
