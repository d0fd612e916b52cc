#include "engine/cpu/attention/dsa_attention.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace exl3::engine {

absl::StatusOr<std::unique_ptr<DsaAttention>> DsaAttention::Load(const ModelConfig& cfg,
                                                                 const TensorSource& src,
                                                                 int layer) {
  std::unique_ptr<DsaAttention> a(new DsaAttention(cfg, layer));
  EXL3_ASSIGN_OR_RETURN(a->mla_, MlaAttention::Load(cfg, src, layer));
  const std::string p = absl::StrCat("model.layers.", layer, ".self_attn.indexer.");
  EXL3_ASSIGN_OR_RETURN(a->indexer_, IndexerProjections::Load(cfg, src, layer, p));
  return a;
}

absl::Status DsaAttention::Forward(const float* x, const StepTokens& tokens, PagedKvCache& cache,
                                   AttentionCarry& carry, float* out, CpuCompute& compute) {
  MlaAttention::SelectPositions select;
  if (indexer_) select = std::bind_front(&DsaAttention::Select, this);
  return mla_->ForwardSelected(x, tokens, cache, carry, select,
                               "shares the top-k selection of an earlier layer, and none ran an indexer this step",
                               out, compute);
}

absl::Status DsaAttention::Select(const float* x, const std::vector<float>& q_resid,
                                  const StepTokens& tokens, PagedKvCache& cache,
                                  TopkSelection* selection, CpuCompute& compute) const {
  const int T = tokens.num_tokens, NI = cfg_.indexer.num_heads, DI = cfg_.indexer.head_dim;
  const int topk = cfg_.indexer.topk;
  const int key_offset = cfg_.kv_lora_rank + cfg_.qk_rope_head_dim;  // after the MLA part
  std::vector<float> qi(static_cast<size_t>(T) * NI * DI), ki(static_cast<size_t>(T) * DI),
      w(static_cast<size_t>(T) * NI);
  EXL3_RETURN_IF_ERROR(indexer_->Forward(x, q_resid.data(), T, NI, DI, qi.data(), ki.data(), w.data(), compute));
  const Rope& rope = mla_->rope();
  RopeAngles angles;
  for (int t = 0; t < T; ++t) {
    float* k = &ki[static_cast<size_t>(t) * DI];
    rope.Angles(tokens.positions[t], tokens.seq_len_after[t], &angles);
    rope.Apply(angles, k, 1, DI);
    rope.Apply(angles, &qi[static_cast<size_t>(t) * NI * DI], NI, DI);
    std::copy_n(k, DI, cache.Slot(layer_, tokens.block_table(t), tokens.positions[t]) + key_offset);
  }

  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(DI)));
  selection->positions.assign(T, {});
  compute.ParallelFor(T, [&](int t) {
    const int pos = tokens.positions[t];
    std::vector<int32_t>& chosen = selection->positions[t];
    chosen.resize(pos + 1);
    std::iota(chosen.begin(), chosen.end(), 0);
    if (pos + 1 <= topk) return;  // it sees no more than top-k positions: all of them
    const std::vector<int32_t>& table = tokens.block_table(t);
    const float* q = &qi[static_cast<size_t>(t) * NI * DI];
    const float* wt = &w[static_cast<size_t>(t) * NI];
    std::vector<float> score(pos + 1);
    for (int j = 0; j <= pos; ++j) {
      const float* k = cache.Slot(layer_, table, j) + key_offset;
      float s = 0.0f;
      for (int h = 0; h < NI; ++h) {
        const float* qh = q + static_cast<size_t>(h) * DI;
        float dot = 0.0f;
        for (int d = 0; d < DI; ++d) dot += qh[d] * k[d];
        s += wt[h] * std::max(dot * scale, 0.0f);
      }
      score[j] = s;
    }
    std::partial_sort(chosen.begin(), chosen.begin() + topk, chosen.end(), [&](int32_t a, int32_t b) {
      return score[a] != score[b] ? score[a] > score[b] : a < b;
    });
    chosen.resize(topk);
    std::sort(chosen.begin(), chosen.end());
  });
  return absl::OkStatus();
}

}  // namespace exl3::engine
