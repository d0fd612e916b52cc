// The drafter of speculative method mtp on the GPU engine: a checkpoint's MTP layer run on the
// model's own hidden states, kept on the device (engine/cuda/cuda_model.h), the GPU counterpart of
// engine/cpu/mtp/mtp_drafter.h. One class per MTP design behind this interface:
//
//   engine/cuda/cuda_mtp_head.h           the DeepSeek-V3 design (DeepseekV3, Glm4Moe, GlmMoeDsa, Glm5Next)
//   engine/cuda/cuda_qwen4exp_mtp_head.h  Qwen4-Exp's, over the gated hyper-connection streams
//
// DeepSeek-V4's mtp.* is not a next-token head but the DSPARK block drafter (docs/dspark.md): one
// forward drafts a whole block from main-kv rows derived from the trunk's taps. It has an interface
// of its own, engine/cuda/cuda_dspark_drafter.h (as the CPU engine's engine/cpu/mtp/dspark_drafter.h
// stands beside engine/cpu/mtp/mtp_drafter.h); engine/cuda/mtp_drafting.h drives either kind.
//
// The drafter's layer is the model's config with one more layer (WithMtpLayer); its attention is a
// mixer kind of its own (engine/cuda/load_cuda_mixers.h LoadCudaLayerMixer) with its own KV cache, which
// AllocateCache sizes with the model's. A step runs as the model's do: the StepTokens of a batch
// whose chunks hold the next tokens at the kept states' positions (engine/core/model_runner.h
// MtpSpan), every launch on the model's stream, nothing synchronised:
//
//   EXL3_RETURN_IF_ERROR(CheckCudaMtpDrafter(cfg, src));                  // engine/cuda/load_cuda_mtp_drafter.h
//   EXL3_ASSIGN_OR_RETURN(auto mtp, LoadCudaMtpDrafter(cfg, src, model_parts));
//   EXL3_RETURN_IF_ERROR(mtp->AllocateCache(shape, stream));
//   EXL3_RETURN_IF_ERROR(mtp->Forward(tokens, states, out, logits));   // device pointers
//   ... synchronise ...
//   EXL3_RETURN_IF_ERROR(mtp->EndStep(*tokens.batch));
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "engine/config/model_config.h"
#include "engine/core/model_runner.h"
#include "engine/core/step_tokens.h"
#include "engine/cpu/mtp/mtp_drafter.h"
#include "engine/cuda/cuda_linear.h"
#include "engine/cuda/engine_kernels.h"
#include "model/safetensors.h"

namespace exl3::engine::cuda {

// What an MTP drafter shares with its model on the GPU.
struct CudaMtpModelParts {
  CudaLinearContext linear;  // the model's stream, cuBLAS handle and linear workspace
  int sm_count = 1;
  bool tensor_core_prefill = true;  // CudaModelOptions'
  int max_moe_tokens = 2048;        // CudaModelOptions': rows of the layer's MoE workspace
  const void* embedding = nullptr;  // the model's embeddings [vocab, hidden] (device), as stored
  EmbeddingDType embedding_dtype = EmbeddingDType::kF32;
  const CudaLinear* head = nullptr;  // the model's lm_head; must outlive the drafter
};

class CudaMtpDrafter {
 public:
  virtual ~CudaMtpDrafter() = default;
  // The model state the drafter reads at each position, state_width() floats a token.
  virtual MtpInput input() const = 0;
  virtual int state_width() const = 0;
  // The layer's cache for `shape` (as the model's mixer kinds: one spare block), and its bytes per token.
  virtual absl::Status AllocateCache(const KvCacheShape& shape, StreamHandle stream) = 0;
  virtual int64_t KvBytesPerToken() const = 0;
  // out [T, state_width] from `states` [T, state_width] (the model's kept states, or this drafter's
  // own out when chaining) and the embedded tokens.token_ids (the next tokens) at tokens.positions,
  // writing the layer's KV there; logits [R, vocab] of the rows tokens.logit_tokens (R of them).
  // Device pointers; queued on the model's stream.
  virtual absl::Status Forward(const StepTokens& tokens, const float* states, float* out, float* logits) = 0;
  // After the step's synchronisation, when it succeeded.
  virtual absl::Status EndStep(const StepBatch& batch) = 0;
};

}  // namespace exl3::engine::cuda
