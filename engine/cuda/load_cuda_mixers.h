// The CUDA model's mixer factory: every layer's CudaMixer (engine/cuda/cuda_mixer.h) and the kinds
// they belong to, as engine/cpu/attention/load_attention.h is the CPU engine's attention factory.
// A new kind is one mixer file pair behind engine/cuda/cuda_mixer.h and one line in
// load_cuda_mixers.cc (the kinds' headers include the interface, never this factory).
//
//   EXL3_ASSIGN_OR_RETURN(CudaMixers mixers, LoadCudaMixers(cfg, src, device.linear()));
#pragma once

#include <memory>
#include <string>

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

// One layer's mixer in a kind of its own, apart from the model's kinds: the MTP layer of speculative
// method mtp (engine/cuda/cuda_mtp_head.h, cuda_qwen4exp_mtp_head.h), whose cache and workspace are
// its own. `cfg` (the model's with that layer counted, engine/cpu/mtp/mtp_drafter.h WithMtpLayer)
// must outlive it. `prefix` empty: the layer's tensors under the model's layer prefix; else under
// `prefix` (CudaMixerKind::LoadLayerUnder).
struct CudaLayerMixer {
  std::unique_ptr<CudaMixerKind> kind;
  std::unique_ptr<CudaMixer> mixer;  // kind's layer `layer`
};
absl::StatusOr<CudaLayerMixer> LoadCudaLayerMixer(const ModelConfig& cfg, const TensorSource& src, int layer,
                                                  const CudaLinearContext& linear, const std::string& prefix = "");

}  // namespace exl3::engine::cuda
