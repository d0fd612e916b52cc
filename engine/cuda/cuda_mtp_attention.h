// The attention of a GPU MTP head's decoder layer (engine/cuda/cuda_mtp_head.h,
// cuda_qwen4exp_mtp_head.h) with the step it runs on: the layer's mixer in a kind of its own
// (load_cuda_mixers.h LoadCudaLayerMixer), the step facts of that kind and their device copy.
// Every MTP step runs all of its rows through the layer (no rows of another micro-batch).
//
//   EXL3_ASSIGN_OR_RETURN(m->attention_, CudaMtpAttention::Load(m->cfg_, src, n, parts));
//   EXL3_ASSIGN_OR_RETURN(const CudaStep* step, attention_.BeginStep(tokens, stream));
//   EXL3_RETURN_IF_ERROR(attention_.Forward(*step, x, T, d));   ... attention_.EndStep(batch, stream)
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/config/model_config.h"
#include "engine/core/step_tokens.h"
#include "engine/cuda/cuda_mtp_drafter.h"
#include "engine/cuda/device_array.h"
#include "engine/cuda/load_cuda_mixers.h"
#include "engine/cuda/step_facts.h"
#include "model/safetensors.h"

namespace exl3::engine::cuda {

class CudaMtpAttention {
 public:
  // Layer `layer`'s mixer (`prefix` as LoadCudaLayerMixer's) and its kind's step facts; `cfg`
  // (the model's with the MTP layer counted) must outlive it.
  static absl::StatusOr<CudaMtpAttention> Load(const ModelConfig& cfg, const TensorSource& src, int layer,
                                               const CudaMtpModelParts& parts, const std::string& prefix = "");

  absl::Status AllocateCache(const KvCacheShape& shape, StreamHandle stream);
  int64_t KvBytesPerToken() const { return layer_.kind->KvBytesPerToken(); }
  // The step over every row of `tokens`: the kind's step begun, the facts packed, uploaded and
  // bound, then the kind's workspace grown for them.
  absl::StatusOr<const CudaStep*> BeginStep(const StepTokens& tokens, StreamHandle stream);
  // out [T, hidden] = the attention of x [T, hidden] (the step's rows).
  absl::Status Forward(const CudaStep& step, const float* x, int T, float* out) {
    return layer_.mixer->Forward(step, x, 0, T, out);
  }
  absl::Status EndStep(const StepBatch& batch, StreamHandle stream) { return layer_.kind->EndStep(batch, stream); }

 private:
  CudaLayerMixer layer_;
  std::unique_ptr<StepFacts> facts_;
  DeviceArray<int32_t> step_facts_;  // the uploaded facts of the last step
};

}  // namespace exl3::engine::cuda
