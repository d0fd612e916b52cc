// Qwen4-Exp's QSA attention (`indexed_attention` layers, `self_attn.*`; docs/engine.md
// "Qwen4-Exp"): Qwen3-Next's gated GQA (q_proj per head query then output gate, zero-centred
// q_norm / k_norm, partial half-split rope, output · sigmoid(gate) before o_proj) whose queries
// attend only to the positions a QSA indexer selects:
//
//   index_qk_proj(x) → indexer_n_heads query heads and one key head of indexer_head_dim
//   q = rope(q_layernorm(q)) at the query's position; the raw key is cached per token
//   query at position t: blocks b = 0 .. ⌊(t+1)/m⌋−1 of m = indexer_compress_ratio positions,
//     key_b = rope(k_layernorm(mean of the block's raw keys)) at position b·m,
//     score_b = Σ_heads relu(q_h · key_b) / √indexer_head_dim;
//   it sees the positions of the budget/m best blocks (every block while there are no more)
//   and of its incomplete last block.
//
// A cache slot holds [k of every KV head, v of every KV head, the raw indexer key].
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "engine/cpu/attention/attention.h"
#include "engine/cpu/linear.h"
#include "engine/config/qwen4exp_config.h"
#include "engine/cpu/rope.h"

namespace exl3::engine {

// The positions a query at `position` attends to, ascending: the tokens of the block_topk
// complete blocks with the highest scores (ties: the earlier block), then the incomplete
// tail. `scores` [⌊(position+1)/m⌋] are its block scores.
std::vector<int32_t> QsaSelectedPositions(const std::vector<float>& scores, int position,
                                          const QsaIndexerConfig& indexer);

// score_b = Σ_h relu(q_h · keys_b) / √head_dim for the first `num_blocks` block keys
// ([num_blocks, head_dim]) and the query's heads q [num_heads, head_dim].
void QsaBlockScores(const float* q, const float* block_keys, int num_blocks, const QsaIndexerConfig& indexer,
                    std::vector<float>* scores);

class QsaAttention final : public Attention {
 public:
  static absl::StatusOr<std::unique_ptr<QsaAttention>> Load(const ModelConfig& cfg, const TensorSource& src,
                                                            int layer);
  // Layer `layer` (its cache layer) with its tensors under `layer_prefix` + "self_attn." (Qwen4-Exp's
  // MTP layer: "mtp.layers.0.").
  static absl::StatusOr<std::unique_ptr<QsaAttention>> Load(const ModelConfig& cfg, const TensorSource& src,
                                                            int layer, const std::string& layer_prefix);
  absl::Status Forward(const float* x, const StepTokens& tokens, PagedKvCache& cache, AttentionCarry& carry,
                       float* out, CpuCompute& compute) override;

 private:
  QsaAttention(const ModelConfig& cfg, int layer);

  const ModelConfig& cfg_;
  const QsaIndexerConfig indexer_;
  int layer_;
  Rope rope_;
  Linear q_, k_, v_, o_, index_qk_;
  std::vector<float> q_norm_, k_norm_;              // [head_dim], 1 + w
  std::vector<float> index_q_norm_, index_k_norm_;  // [indexer head_dim], 1 + w
};

}  // namespace exl3::engine
