#include "engine/cuda/cuda_mtp_attention.h"

#include <utility>

#include "base/status_macros.h"

namespace exl3::engine::cuda {

absl::StatusOr<CudaMtpAttention> CudaMtpAttention::Load(const ModelConfig& cfg, const TensorSource& src, int layer,
                                                        const CudaMtpModelParts& parts, const std::string& prefix) {
  CudaMtpAttention a;
  EXL3_ASSIGN_OR_RETURN(a.layer_, LoadCudaLayerMixer(cfg, src, layer, parts.linear, prefix));
  SplitShape split = a.layer_.kind->split_shape();
  if (split.blocks_per_token == 0) split = SplitShape{1};
  a.facts_ = std::make_unique<StepFacts>(cfg, split, parts.sm_count, parts.tensor_core_prefill);
  return a;
}

absl::Status CudaMtpAttention::AllocateCache(const KvCacheShape& shape, StreamHandle stream) {
  EXL3_RETURN_IF_ERROR(layer_.kind->AllocateCache(shape, stream));
  facts_->SetCache(shape);
  return absl::OkStatus();
}

absl::StatusOr<const CudaStep*> CudaMtpAttention::BeginStep(const StepTokens& tokens, StreamHandle stream) {
  const int T = tokens.num_tokens;
  CudaMixerKind& kind = *layer_.kind;
  EXL3_RETURN_IF_ERROR(kind.BeginStep(*tokens.batch, stream));
  EXL3_RETURN_IF_ERROR(facts_->Pack(tokens, StepLayout{T, 0, 0}));
  EXL3_RETURN_IF_ERROR(kind.PackStep(tokens, T, &facts_->host()));
  EXL3_ASSIGN_OR_RETURN(const CudaStep* step, facts_->Upload(&step_facts_, stream));
  EXL3_RETURN_IF_ERROR(kind.BindStep(*step, tokens, step_facts_.get(), stream));
  bool moved = false;  // no decode graph holds these addresses
  EXL3_RETURN_IF_ERROR(kind.Reserve(T, step->splits, &moved));
  return step;
}

}  // namespace exl3::engine::cuda
