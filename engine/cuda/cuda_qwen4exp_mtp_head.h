// Qwen4-Exp's (Qwen3.8-Flash-Next) MTP head on the GPU: the CPU engine's
// engine/cpu/mtp/qwen4exp_mtp_head.h (where its tensors, formulas and their sources are written
// down) built from the GPU engine's blocks. From the model's streams h_i [S, hidden] before its
// head collapses them (ResidualStream::CopyStreams) and the token t_{i+1}:
//
//   s_k = fc_hidden(norm_k(h_i,k)) + fc_embedding(norm_e(embed(t_{i+1})))   every stream k; cuda_linear.h
//   o   = the block on the streams s: attn_hyper_connection around QSA attention (a mixer kind of
//         its own, load_cuda_mixers.h LoadCudaLayerMixer under mtp.layers.0.), mlp_hyper_connection
//         around the MoE (cuda_mtp_moe.h, its gated shared expert); engine/cuda/gated_connection.h
//   logits = lm_head(mtp.hyper_connection_mixer(o))                         the model's head
//
// Chained drafts run the block on its own output streams o (the caller, as for every design).
#pragma once

#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "engine/cuda/cuda_linear.h"
#include "engine/cuda/cuda_mtp_attention.h"
#include "engine/cuda/cuda_mtp_drafter.h"
#include "engine/cuda/cuda_mtp_moe.h"
#include "engine/cuda/device_array.h"
#include "engine/cuda/gated_connection.h"

namespace exl3::engine::cuda {

class CudaQwen4ExpMtpHead final : public CudaMtpDrafter {
 public:
  // The model's config `cfg` (a Qwen4-Exp one, not yet with the MTP layer); `src` holds mtp.*
  // (checked by name).
  static absl::StatusOr<std::unique_ptr<CudaQwen4ExpMtpHead>> Load(const ModelConfig& cfg, const TensorSource& src,
                                                                   const CudaMtpModelParts& parts);
  CudaQwen4ExpMtpHead(const CudaQwen4ExpMtpHead&) = delete;
  CudaQwen4ExpMtpHead& operator=(const CudaQwen4ExpMtpHead&) = delete;

  MtpInput input() const override { return MtpInput::kStreams; }
  int state_width() const override { return shape_.streams * shape_.hidden; }
  absl::Status AllocateCache(const KvCacheShape& shape, StreamHandle stream) override;
  int64_t KvBytesPerToken() const override { return attention_.KvBytesPerToken(); }
  absl::Status Forward(const StepTokens& tokens, const float* states, float* out, float* logits) override;
  absl::Status EndStep(const StepBatch& batch) override;

 private:
  CudaQwen4ExpMtpHead(ModelConfig cfg, const GatedResidualShape& shape, const CudaMtpModelParts& parts)
      : cfg_(std::move(cfg)), shape_(shape), parts_(parts) {}
  // Grows the step buffers for T rows and R logit rows.
  absl::Status Reserve(int T, int R);

  const ModelConfig cfg_;  // the model's with the MTP layer (index num_layers - 1); its blocks keep references
  const GatedResidualShape shape_;
  const CudaMtpModelParts parts_;
  DeviceArray<float> hidden_norm_;     // 1 + w [streams * hidden]
  DeviceArray<float> embedding_norm_;  // 1 + w [hidden]
  CudaLinear fc_hidden_, fc_embedding_;
  std::optional<CudaGatedConnection> attn_connection_, mlp_connection_, head_mixer_;
  CudaMtpAttention attention_;
  std::optional<CudaMtpMoe> moe_;
  GatedConnectionWorkspace connection_ws_;
  // [T, hidden]: one stream of the states (then normed), the embedding branch, the blocks' input and
  // output; [T, streams, hidden]: the normed states, the embedding branch in every stream;
  // [T, streams] the inject weights; [R, hidden] the head's input.
  DeviceArray<float> stream_, e_, x_, d_, normed_, broadcast_, inject_, head_in_;
};

}  // namespace exl3::engine::cuda
