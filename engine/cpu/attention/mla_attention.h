// DeepSeek multi-head latent attention. Queries through q_a_proj → q_a_layernorm → q_b_proj (or
// one q_proj), split per head into a no-rope part and a rope part; kv_a_proj_with_mqa gives the
// latent (kv_a_layernorm'd) and one rope key shared by all heads. A cache slot begins with
// [latent (kv_lora_rank), rotated shared key (qk_rope_head_dim)], as transformers caches it.
//
// kv_b_proj is absorbed: for head h, q_nope · W_uk(h) maps the query into the latent space, the
// scores are that · latent + q_rope · k_rope, and the output is W_uv(h) · (softmax-weighted sum of
// latents). The same arithmetic as expanding every cached latent into keys and values, reordered.
//
// Forward is the two halves below in a row; DSA (engine/cpu/attention/dsa_attention.h) and
// GLM-5.3-Flash's indexed attention (kpool_dsa_attention.h) run their indexer between them
// (ForwardSelected) and hand the second the positions it chose.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "engine/cpu/attention/attention.h"
#include "engine/cpu/linear.h"
#include "engine/cpu/rope.h"

namespace exl3::engine {

class MlaAttention final : public Attention {
 public:
  static absl::StatusOr<std::unique_ptr<MlaAttention>> Load(const ModelConfig& cfg,
                                                            const TensorSource& src, int layer);
  absl::Status Forward(const float* x, const StepTokens& tokens, PagedKvCache& cache,
                       AttentionCarry& carry, float* out, CpuCompute& compute) override;

  // The step's queries [T, heads, nope + rope] (rope part rotated) and, with a low-rank q, the
  // normalised q_a_proj output [T, q_lora_rank] (else left empty); writes each token's latent
  // and rotated shared key to the start of its cache slot.
  absl::Status ProjectAndCache(const float* x, const StepTokens& tokens, PagedKvCache& cache,
                               std::vector<float>* q, std::vector<float>* q_resid,
                               CpuCompute& compute) const;
  // Each token's heads attend to the cached positions it sees: its causal range (within the
  // sliding window) or, given a selection, exactly selection->positions[t]; then o_proj into
  // out [T, hidden].
  absl::Status AttendAndProject(const std::vector<float>& q, const StepTokens& tokens,
                                PagedKvCache& cache, const TopkSelection* selection, float* out,
                                CpuCompute& compute) const;
  // Chooses each token's positions (selection->positions[t]) from the step's inputs x and its
  // low-rank query residual (ProjectAndCache's q_resid), writing what the selection keeps to the
  // cache (an indexer's keys).
  using SelectPositions =
      std::function<absl::Status(const float* x, const std::vector<float>& q_resid, const StepTokens& tokens,
                                 PagedKvCache& cache, TopkSelection* selection, CpuCompute& compute)>;
  // The two halves with a selection between them: `select`'s, handed on in carry.topk, or, where
  // `select` is null (a layer that shares the selection of an earlier one), carry.topk as that
  // layer left it; Internal "layer L <no_selection>" when none did this step.
  absl::Status ForwardSelected(const float* x, const StepTokens& tokens, PagedKvCache& cache, AttentionCarry& carry,
                               const SelectPositions& select, const char* no_selection, float* out,
                               CpuCompute& compute) const;
  const Rope& rope() const { return rope_; }

 private:
  MlaAttention(const ModelConfig& cfg, int layer);

  const ModelConfig& cfg_;
  int layer_;
  Rope rope_;
  bool q_low_rank_ = false;
  Linear q_a_, q_b_, q_, kv_a_, o_;
  std::vector<float> q_a_norm_, kv_a_norm_;
  std::vector<float> kv_b_;  // [heads * (nope + v), kv_lora_rank] fp32
};

}  // namespace exl3::engine
