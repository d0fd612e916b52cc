// A checkpoint's MTP head of the DeepSeek-V3 design on the GPU (DeepseekV3, Glm4Moe, GlmMoeDsa,
// Glm5Next): the CPU engine's engine/cpu/mtp/mtp_head.h (where its facts and their sources are
// written down) built from the GPU engine's own blocks. For position i, from the model's state
// after its final norm h_i and the token t_{i+1}:
//
//   x = eh_proj(concat(enorm(embed(t_{i+1})), hnorm(h_i)))       the model's embeddings; cuda_linear.h
//   o = x + attn(input_norm(x)), then o + mlp(post_attention_norm(o))
//       attention: the layer's mixer in a kind of its own (load_cuda_mixers.h LoadCudaLayerMixer: GQA,
//       MLA, DSA with its own indexer, GLM-5.3-Flash's k-pooled NoPE MLA), its cache the drafter's
//       mlp: the MoE (cuda_mtp_moe.h, experts in process even where the model's are on workers: the
//       workers serve the decoder layers only) or the dense MLP (dense_mlp.h)
//   logits = head(shared_head.norm(o))                          shared_head.head, else the model's head
//
// Chained drafts (K > 1) run the layer again on its own o and the draft just made (the caller,
// engine/cuda/cuda_model.cc ProposeMtpDrafts, as the CPU model does).
#pragma once

#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "engine/cuda/cuda_linear.h"
#include "engine/cuda/cuda_mtp_attention.h"
#include "engine/cuda/cuda_mtp_drafter.h"
#include "engine/cuda/cuda_mtp_moe.h"
#include "engine/cuda/dense_mlp.h"
#include "engine/cuda/device_array.h"

namespace exl3::engine::cuda {

class CudaMtpHead final : public CudaMtpDrafter {
 public:
  // The model's config `cfg` (not yet with the MTP layer); `src` holds the layer (checked by name).
  static absl::StatusOr<std::unique_ptr<CudaMtpHead>> Load(const ModelConfig& cfg, const TensorSource& src,
                                                           const CudaMtpModelParts& parts);
  CudaMtpHead(const CudaMtpHead&) = delete;
  CudaMtpHead& operator=(const CudaMtpHead&) = delete;

  MtpInput input() const override { return MtpInput::kHeadInput; }
  int state_width() const override { return cfg_.hidden_size; }
  absl::Status AllocateCache(const KvCacheShape& shape, StreamHandle stream) override;
  int64_t KvBytesPerToken() const override { return attention_.KvBytesPerToken(); }
  absl::Status Forward(const StepTokens& tokens, const float* states, float* out, float* logits) override;
  absl::Status EndStep(const StepBatch& batch) override;

 private:
  CudaMtpHead(ModelConfig cfg, const CudaMtpModelParts& parts) : cfg_(std::move(cfg)), parts_(parts) {}
  // Grows the step buffers for T rows and R logit rows.
  absl::Status Reserve(int T, int R);

  const ModelConfig cfg_;  // the model's with the MTP layer (index num_layers - 1); its blocks keep references
  const CudaMtpModelParts parts_;
  DeviceArray<float> enorm_, hnorm_, input_norm_, post_attention_norm_, shared_norm_;
  CudaLinear eh_proj_;
  CudaMtpAttention attention_;
  std::optional<CudaMtpMoe> moe_;          // MoE layers (the MTP layers of the supported families)
  std::optional<CudaDenseMlp> dense_mlp_;  // else
  std::optional<CudaLinear> own_head_;     // shared_head.head, when stored
  const CudaLinear* head_ = nullptr;       // own_head_ or the model's
  // [T, hidden]: the normed embeddings, then the blocks' input; the normed states, then the blocks'
  // output; [T, 2 hidden] eh_proj's input; [T, intermediate] the dense MLP's; [R, hidden] the head's input.
  DeviceArray<float> x_, d_, cat_, gate_, up_, head_in_;
};

}  // namespace exl3::engine::cuda
