// Qwen4-Exp's (Qwen3.8-Flash-Next, Qwen4ExpForConditionalGeneration) MTP head, the drafter of
// speculative method mtp for that family (engine/cpu/mtp/mtp_drafter.h). transformers 5.25 has no code
// for it (its Qwen4Exp classes skip `^mtp.*` on load); the facts are exllamav3 1.6.5's
// (its qwen4_exp_mtp architecture and its Qwen4-Exp MTP input layer; exllamav3 says no reference
// implementation exists and calls its stream handling a guess to be confirmed by acceptance on
// the real model). Tensors, beside the text model (S = hc_count streams, H = hidden):
//
//   mtp.pre_fc_norm_hidden.weight    [S·H]  zero-centred RMSNorm of each stream (one H-group each)
//   mtp.fc_hidden                    [H, H] applied to every stream
//   mtp.pre_fc_norm_embedding.weight [H]    zero-centred RMSNorm of the next token's embedding
//   mtp.fc_embedding                 [H, H]
//   mtp.layers.0.*                   one decoder block of the model's own kind with full (QSA)
//                                    attention: attn_hyper_connection / mlp_hyper_connection
//                                    (engine/cpu/residual/gated_residual.h), self_attn.* (engine/cpu/attention/qsa_attention.h,
//                                    its own indexer), mlp.* (MoE, gated shared expert; routed
//                                    experts under per-expert names); no PLE
//   mtp.hyper_connection_mixer.*     the combine-less gated residual before the (model's) lm_head
//
// For position i, from the model's streams h_i [S, H] BEFORE its hyper_connection_mixer (the
// stack the model's head collapses) and the token t_{i+1}:
//
//   s_k = fc_hidden(norm_k(h_i,k)) + fc_embedding(norm_e(embed(t_{i+1})))   k = 0 .. S-1
//   o   = the block on the streams s (attention at position i, as the DeepSeek-design head)
//   logits = lm_head(mtp.hyper_connection_mixer(o))                          predicts t_{i+2}
//
// The embedding branch goes into every stream, so the block starts from the model's own streams
// (exllamav3's stream_tap). Drafts beyond the first chain the block on its own output streams o
// (before the mixer) and the draft just made, as exllamav3 feeds its flattened stack back. One MTP
// layer (mtp_num_hidden_layers 1); a checkpoint with mtp.layers.1 is refused.
//
// Positions: the layer's KV entry of (h_i, t_{i+1}) sits at position i, as for the DeepSeek-design
// head (vLLM's convention). exllamav3's generator puts it at i + 1 and writes one more entry at
// position 0 from a zero state and t_0; with QSA's blocks of absolute positions the two
// conventions select differently once a query sees more than indexer_budget positions, so drafts
// compared with exllamav3's must account for the shift.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cpu/residual/gated_residual.h"
#include "engine/cpu/mtp/mtp_drafter.h"
#include "engine/cpu/mtp/mtp_moe.h"
#include "engine/cpu/attention/qsa_attention.h"

namespace exl3::engine {

class Qwen4ExpMtpHead final : public MtpDrafter {
 public:
  // OK when `src` holds the head's tensors (by name otherwise) and has one MTP layer.
  static absl::Status CheckPresent(const ModelConfig& cfg, const TensorSource& src);
  static absl::StatusOr<std::unique_ptr<Qwen4ExpMtpHead>> Load(const ModelConfig& cfg, const TensorSource& src,
                                                               const Linear& model_head);
  Qwen4ExpMtpHead(const Qwen4ExpMtpHead&) = delete;
  Qwen4ExpMtpHead& operator=(const Qwen4ExpMtpHead&) = delete;

  MtpInput input() const override { return MtpInput::kStreams; }
  int state_width() const override { return streams_ * cfg_.hidden_size; }
  int cache_layer() const override { return cfg_.num_layers - 1; }
  KvLayerShape CacheShape(int block_size) const override {
    return {cfg_.KvWidth(cache_layer()), cfg_.KvBlockFloats(cache_layer(), block_size)};
  }
  absl::Status Forward(const float* hidden, const float* embedded, const StepTokens& tokens,
                       PagedKvCache& cache, float* out, CpuCompute& compute) override;
  absl::Status Logits(const float* o, int rows, float* logits, CpuCompute& compute) const override;

 private:
  Qwen4ExpMtpHead(ModelConfig cfg, int streams) : cfg_(std::move(cfg)), streams_(streams) {}

  const ModelConfig cfg_;  // the model's, one layer longer (the attention keeps a reference)
  const int streams_;
  std::vector<float> hidden_norm_;     // 1 + w [streams * hidden]
  std::vector<float> embedding_norm_;  // 1 + w [hidden]
  Linear fc_hidden_, fc_embedding_;
  std::optional<GatedResidual> attn_gr_, ffn_gr_, mixer_;
  std::unique_ptr<QsaAttention> attention_;
  std::optional<MtpMoe> moe_;
  const Linear* head_ = nullptr;  // the model's lm_head
};

}  // namespace exl3::engine
