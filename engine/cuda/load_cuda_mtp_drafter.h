// The GPU engine's MTP drafter of a model's family (engine/cuda/cuda_mtp_drafter.h): the factory
// over the next-token designs (engine/cuda/cuda_mtp_head.h, engine/cuda/cuda_qwen4exp_mtp_head.h),
// apart from the interface they implement, as engine/cpu/mtp/load_mtp_drafter.h is the CPU engine's.
// CheckCudaMtpDrafter also passes DeepSeek-V4's DSPARK block drafter, which is not a next-token
// head: engine/cuda/mtp_drafting.cc loads it (engine/cuda/cuda_dspark_drafter.h) instead.
//
//   EXL3_RETURN_IF_ERROR(CheckCudaMtpDrafter(cfg, src));
//   EXL3_ASSIGN_OR_RETURN(std::unique_ptr<CudaMtpDrafter> d, LoadCudaMtpDrafter(cfg, src, parts));
#pragma once

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/config/model_config.h"
#include "engine/cuda/cuda_mtp_drafter.h"
#include "model/safetensors.h"

namespace exl3::engine::cuda {

// OK when `cfg`'s family has an MTP design the GPU engine runs and `src` holds its layer; else
// FAILED_PRECONDITION naming the architecture and what is missing.
absl::Status CheckCudaMtpDrafter(const ModelConfig& cfg, const TensorSource& src);
// The design's drafter on the device of `parts`.
absl::StatusOr<std::unique_ptr<CudaMtpDrafter>> LoadCudaMtpDrafter(const ModelConfig& cfg, const TensorSource& src,
                                                                   const CudaMtpModelParts& parts);

}  // namespace exl3::engine::cuda
