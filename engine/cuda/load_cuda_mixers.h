// The CUDA model's mixer factory: every layer's CudaMixer (engine/cuda/cuda_mixer.h) and the kinds
// they belong to, as engine/cpu/attention/load_attention.h is the CPU engine's attention factory.
// A new kind is one mixer file pair behind engine/cuda/cuda_mixer.h and one line in
// load_cuda_mixers.cc (the kinds' headers include the interface, never this factory).
//
//   EXL3_ASSIGN_OR_RETURN(CudaMixers mixers, LoadCudaMixers(cfg, src, device.linear()));
#pragma once

#include "absl/status/statusor.h"
#include "engine/cuda/cuda_linear.h"
#include "engine/cuda/cuda_mixer.h"
#include "engine/config/model_config.h"
#include "model/safetensors.h"

namespace exl3::engine::cuda {

// The mixers of every layer of the model in `src`, on the device of `linear`. UNIMPLEMENTED, naming
// the layer and its kind, when a layer's kind has no GPU mixer (checked before anything is loaded).
absl::StatusOr<CudaMixers> LoadCudaMixers(const ModelConfig& cfg, const TensorSource& src,
                                          const CudaLinearContext& linear);

}  // namespace exl3::engine::cuda
