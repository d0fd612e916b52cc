#include "engine/cpu/attention/dsa_attention.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace exl3::engine {
namespace {

constexpr float kIndexerNormEps = 1e-6f;  // the indexer's k_norm (nn.LayerNorm(eps=1e-6))

// LayerNorm with weight and bias over n values, in place (mean and variance in double).
void LayerNormInPlace(float* x, const float* w, const float* b, int n, float eps) {
  double mean = 0.0;
  for (int i = 0; i < n; ++i) mean += x[i];
  mean /= n;
  double var = 0.0;
  for (int i = 0; i < n; ++i) var += (x[i] - mean) * (x[i] - mean);
  var /= n;
  const float inv = static_cast<float>(1.0 / std::sqrt(var + eps));
  const float m = static_cast<float>(mean);
  for (int i = 0; i < n; ++i) x[i] = (x[i] - m) * inv * w[i] + b[i];
}

}  // namespace

absl::StatusOr<std::unique_ptr<DsaAttention>> DsaAttention::Load(const ModelConfig& cfg,
                                                                 const TensorSource& src,
                                                                 int layer) {
  std::unique_ptr<DsaAttention> a(new DsaAttention(cfg, layer));
  EXL3_ASSIGN_OR_RETURN(a->mla_, MlaAttention::Load(cfg, src, layer));
  const std::string p = absl::StrCat("model.layers.", layer, ".self_attn.indexer.");
  const bool has_tensors = src.Has(p + "wk.weight") || src.Has(p + "wk.trellis");
  if (!cfg.HasOwnIndexer(layer)) {
    if (has_tensors)
      return absl::InvalidArgumentError(absl::StrCat(
          p, "*: layer ", layer, " has indexer weights but config.json marks it shared"));
    return a;
  }
  const IndexerConfig& ix = cfg.indexer;
  Indexer in;
  EXL3_ASSIGN_OR_RETURN(in.wq_b, Linear::Load(src, p + "wq_b", cfg.q_lora_rank, ix.num_heads * ix.head_dim));
  EXL3_ASSIGN_OR_RETURN(in.wk, Linear::Load(src, p + "wk", cfg.hidden_size, ix.head_dim));
  EXL3_ASSIGN_OR_RETURN(in.weights_proj, Linear::Load(src, p + "weights_proj", cfg.hidden_size, ix.num_heads));
  EXL3_ASSIGN_OR_RETURN(in.k_norm_weight, LoadVector(src, p + "k_norm.weight", ix.head_dim));
  EXL3_ASSIGN_OR_RETURN(in.k_norm_bias, LoadVector(src, p + "k_norm.bias", ix.head_dim));
  a->indexer_ = std::move(in);
  return a;
}

absl::Status DsaAttention::Forward(const float* x, const StepTokens& tokens, PagedKvCache& cache,
                                   AttentionCarry& carry, float* out, CpuCompute& compute) {
  std::vector<float> q, q_resid;
  EXL3_RETURN_IF_ERROR(mla_->ProjectAndCache(x, tokens, cache, &q, &q_resid, compute));
  if (indexer_) {
    TopkSelection selection;
    EXL3_RETURN_IF_ERROR(Select(x, q_resid, tokens, cache, &selection, compute));
    carry.topk = std::move(selection);
  } else if (!carry.topk || static_cast<int>(carry.topk->positions.size()) != tokens.num_tokens) {
    return absl::InternalError(absl::StrCat("layer ", layer_, " shares the top-k selection of an "
                                            "earlier layer, and none ran an indexer this step"));
  }
  return mla_->AttendAndProject(q, tokens, cache, &*carry.topk, out, compute);
}

absl::Status DsaAttention::Select(const float* x, const std::vector<float>& q_resid,
                                  const StepTokens& tokens, PagedKvCache& cache,
                                  TopkSelection* selection, CpuCompute& compute) const {
  const Indexer& in = *indexer_;
  const int T = tokens.num_tokens, NI = cfg_.indexer.num_heads, DI = cfg_.indexer.head_dim;
  const int topk = cfg_.indexer.topk;
  const int key_offset = cfg_.kv_lora_rank + cfg_.qk_rope_head_dim;  // after the MLA part
  std::vector<float> qi(static_cast<size_t>(T) * NI * DI), ki(static_cast<size_t>(T) * DI),
      w(static_cast<size_t>(T) * NI);
  EXL3_RETURN_IF_ERROR(in.wq_b.Forward(q_resid.data(), T, qi.data(), compute));
  EXL3_RETURN_IF_ERROR(in.wk.Forward(x, T, ki.data(), compute));
  EXL3_RETURN_IF_ERROR(in.weights_proj.Forward(x, T, w.data(), compute));
  const float head_weight = static_cast<float>(1.0 / std::sqrt(static_cast<double>(NI)));
  for (float& v : w) v *= head_weight;
  const Rope& rope = mla_->rope();
  RopeAngles angles;
  for (int t = 0; t < T; ++t) {
    float* k = &ki[static_cast<size_t>(t) * DI];
    LayerNormInPlace(k, in.k_norm_weight.data(), in.k_norm_bias.data(), DI, kIndexerNormEps);
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
