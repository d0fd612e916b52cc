// A checkpoint's MTP (multi-token prediction) head of the DeepSeek-V3 design, as DeepseekV3,
// Glm4Moe (GLM-4.5, num_nextn_predict_layers), GlmMoeDsa (GLM-5) and Glm5Next (GLM-5.3-Flash)
// checkpoints carry it: one more decoder layer, model.layers.{num_hidden_layers}.* (GLM-5.3-Flash:
// model.language_model.layers.{num_hidden_layers}.*), with enorm, hnorm, eh_proj,
// shared_head.norm and optionally shared_head.head (else the model's lm_head); the embeddings
// are the model's. For position i, from the model's hidden state h_i and the token t_{i+1}:
//
//   x = eh_proj(concat(enorm(embed(t_{i+1})), hnorm(h_i)))      // [2H] -> [H]
//   o = the layer (input norm, attention, residual, post-attention norm, MLP, residual) on x
//   logits = head(shared_head.norm(o))                          // predicts t_{i+2}
//
// Facts and where they come from (the transformers families load none of these tensors):
//   * h_i is the model's hidden state AFTER its final norm (the head's input): vLLM's DeepSeek
//     model returns the normed state to its MTP proposer, and exllamav3 1.6.5's GLM MTP heads
//     tap the post-final-norm state too (its authors measured higher acceptance than with the
//     pre-norm residual).
//   * the concat is the embedding first, then the hidden state (vLLM's DeepSeek MTP layer and
//     exllamav3's MTP input layer agree; the DeepSeek-V3 report writes the other order, the
//     released eh_proj weights follow the code).
//   * the layer's attention keeps its own KV over the sequence's positions: position i's entry
//     comes from (h_i, t_{i+1}) at rope position i (vLLM runs the MTP at the target's
//     positions; exllamav3 at the token's, i + 1: rope is relative, so the same scores), so it
//     must run over every position whose hidden state exists, prefill too (vLLM, SGLang).
//     vLLM also zeroes the embedding at position 0; the formula above does not (nor
//     exllamav3), and neither does this head.
//   * drafts beyond the first (K > 1) chain the one layer: the next position's input is this
//     head's own output o (before shared_head.norm) and the draft token it just predicted, as
//     vLLM does for DeepSeek with one MTP layer (exllamav3 feeds back the normed state instead).
//   * the head is shared_head.head when stored (vLLM loads it), else the model's lm_head (which
//     exllamav3 always uses).
//   * GLM-5's MTP layer (GlmMoeDsa) runs its own DSA indexer, and the whole MoE (exllamav3).
//   * GLM-5.3-Flash (Glm5NextForConditionalGeneration) has the same design (exllamav3 1.6.5's
//     Glm5Next MTP model; transformers 5.25 has no MTP code for it and skips the layer on load):
//     the layer is model.language_model.layers.{num_hidden_layers}.* (enorm, hnorm, eh_proj,
//     shared_head.norm, no shared_head.head). h_i is the state its head reads: the mean of the
//     hc_mult hyper-connection streams (hc_head), then the model's final norm. The layer itself
//     has no hyper-connections (no hc_attn_ / hc_ffn_ tensors): a plain residual block whose
//     mixer is the NoPE MLA with its own k-pooled indexer ("full", never KDA: nothing recurrent
//     to roll back) and whose MLP is the MoE (sigmoid routing with the correction bias, one
//     shared expert, swiglu_limit on both). exllamav3 lets the layer's indexer score on its own
//     rather than reuse the model's selection (the config's index_share_for_mtp_iteration);
//     so does this head. Without rope the positions only order the layer's KV and pools; but the
//     pools are of absolute positions, and exllamav3's generator keeps the entry of
//     (h_i, t_{i+1}) at i + 1 (plus one at 0 from a zero state and t_0), so past index_topk its
//     selection, and so its drafts, can differ from this head's.
//
//   EXL3_ASSIGN_OR_RETURN(auto mtp, MtpHead::Load(cfg, src, model_head));
//   EXL3_RETURN_IF_ERROR(mtp->Forward(h, embedded, tokens, cache, out, compute));
//   EXL3_RETURN_IF_ERROR(mtp->Logits(out_rows, rows, logits, compute));
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cpu/attention/attention.h"
#include "engine/cpu/cpu_compute.h"
#include "engine/cpu/linear.h"
#include "engine/config/model_config.h"
#include "engine/cpu/mtp/mtp_drafter.h"
#include "engine/cpu/mtp/mtp_moe.h"
#include "engine/cpu/paged_kv_cache.h"
#include "engine/core/step_tokens.h"
#include "model/safetensors.h"

namespace exl3::engine {

class MtpHead final : public MtpDrafter {
 public:
  // OK when `cfg`'s family has the DeepSeek-V3 MTP design and `src` holds its layer; else
  // FAILED_PRECONDITION naming the architecture and what is missing.
  static absl::Status CheckPresent(const ModelConfig& cfg, const TensorSource& src);
  // `model_head` (the model's lm_head) must outlive the head; used when the layer has no
  // shared_head.head of its own.
  static absl::StatusOr<std::unique_ptr<MtpHead>> Load(const ModelConfig& cfg, const TensorSource& src,
                                                       const Linear& model_head);
  MtpHead(const MtpHead&) = delete;
  MtpHead& operator=(const MtpHead&) = delete;

  // It reads the model's state after its final norm (MtpInput::kHeadInput), hidden wide.
  MtpInput input() const override { return MtpInput::kHeadInput; }
  int state_width() const override { return cfg_.hidden_size; }
  // The cache layer the head's attention uses: num_hidden_layers (one past the decoder layers).
  int cache_layer() const override { return cfg_.num_layers - 1; }
  KvLayerShape CacheShape(int block_size) const override {
    return {cfg_.KvWidth(cache_layer()), cfg_.KvBlockFloats(cache_layer(), block_size)};
  }

  // out [T, H] = the layer's output o for hidden states `hidden` [T, H] (the model's, or this
  // head's own o when chaining) and the embedded next tokens `embedded` [T, H] (tokens.token_ids
  // are those tokens, tokens.positions the positions of the hidden states); writes the layer's
  // KV at those positions.
  absl::Status Forward(const float* hidden, const float* embedded, const StepTokens& tokens,
                       PagedKvCache& cache, float* out, CpuCompute& compute) override;
  // logits [rows, vocab] = head(shared_head.norm(o)) for `rows` rows of o.
  absl::Status Logits(const float* o, int rows, float* logits, CpuCompute& compute) const override;

 private:
  struct DenseMlp {
    Linear gate, up, down;
  };
  explicit MtpHead(ModelConfig cfg) : cfg_(std::move(cfg)) {}

  const ModelConfig cfg_;  // the model's, one layer longer (the attention keeps a reference)
  std::vector<float> enorm_, hnorm_, input_norm_, post_attention_norm_, shared_norm_;
  Linear eh_proj_;
  std::unique_ptr<Attention> attention_;
  std::optional<MtpMoe> moe_;          // MoE layers (the MTP layers of the supported families)
  std::optional<DenseMlp> dense_mlp_;  // else
  std::optional<Linear> own_head_;     // shared_head.head, when stored
  const Linear* head_ = nullptr;       // own_head_ or the model's
};

}  // namespace exl3::engine
