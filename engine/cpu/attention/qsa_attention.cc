#include "engine/cpu/attention/qsa_attention.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cpu/rms_norm.h"

namespace exl3::engine {

std::vector<int32_t> QsaSelectedPositions(const std::vector<float>& scores, int position,
                                          const QsaIndexerConfig& ix) {
  const int m = ix.compress_ratio;
  const int blocks = (position + 1) / m;
  std::vector<int> order(blocks);
  std::iota(order.begin(), order.end(), 0);
  const int keep = std::min(ix.block_topk(), blocks);
  std::partial_sort(order.begin(), order.begin() + keep, order.end(), [&](int a, int b) {
    return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
  });
  order.resize(keep);
  std::sort(order.begin(), order.end());
  std::vector<int32_t> positions;
  positions.reserve(static_cast<size_t>(keep) * m + m);
  for (int b : order)
    for (int i = 0; i < m; ++i) positions.push_back(b * m + i);
  for (int p = blocks * m; p <= position; ++p) positions.push_back(p);
  return positions;
}

void QsaBlockScores(const float* q, const float* block_keys, int num_blocks, const QsaIndexerConfig& ix,
                    std::vector<float>* scores) {
  const int D = ix.head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  scores->assign(num_blocks, 0.0f);
  for (int b = 0; b < num_blocks; ++b) {
    const float* kb = block_keys + static_cast<size_t>(b) * D;
    float sum = 0.0f;
    for (int h = 0; h < ix.num_heads; ++h) {
      const float* qh = q + static_cast<size_t>(h) * D;
      float dot = 0.0f;
      for (int d = 0; d < D; ++d) dot += qh[d] * kb[d];
      sum += std::max(dot, 0.0f);
    }
    (*scores)[b] = sum * scale;
  }
}

QsaAttention::QsaAttention(const ModelConfig& cfg, int layer)
    : cfg_(cfg), indexer_(cfg.qwen4exp->indexer), layer_(layer), rope_(cfg.rope, cfg.max_position_embeddings) {}

absl::StatusOr<std::unique_ptr<QsaAttention>> QsaAttention::Load(const ModelConfig& cfg, const TensorSource& src,
                                                                  int layer) {
  return Load(cfg, src, layer, LayerPrefix(cfg.moe, layer));
}

absl::StatusOr<std::unique_ptr<QsaAttention>> QsaAttention::Load(const ModelConfig& cfg, const TensorSource& src,
                                                                  int layer, const std::string& layer_prefix) {
  std::unique_ptr<QsaAttention> a(new QsaAttention(cfg, layer));
  const std::string p = layer_prefix + "self_attn.";
  const int H = cfg.hidden_size, q_out = cfg.num_heads * cfg.head_dim, kv_out = cfg.num_kv_heads * cfg.head_dim;
  const QsaIndexerConfig& ix = a->indexer_;
  EXL3_ASSIGN_OR_RETURN(a->q_, Linear::Load(src, p + "q_proj", H, 2 * q_out));
  EXL3_ASSIGN_OR_RETURN(a->k_, Linear::Load(src, p + "k_proj", H, kv_out));
  EXL3_ASSIGN_OR_RETURN(a->v_, Linear::Load(src, p + "v_proj", H, kv_out));
  EXL3_ASSIGN_OR_RETURN(a->o_, Linear::Load(src, p + "o_proj", q_out, H));
  const NormWeightConvention zc = NormWeightConvention::kOffsetFromOne;
  EXL3_ASSIGN_OR_RETURN(a->q_norm_, LoadNormWeight(src, p + "q_norm.weight", cfg.head_dim, zc));
  EXL3_ASSIGN_OR_RETURN(a->k_norm_, LoadNormWeight(src, p + "k_norm.weight", cfg.head_dim, zc));
  EXL3_ASSIGN_OR_RETURN(a->index_qk_, Linear::Load(src, p + "indexer.index_qk_proj", H, (ix.num_heads + 1) * ix.head_dim));
  EXL3_ASSIGN_OR_RETURN(a->index_q_norm_, LoadNormWeight(src, p + "indexer.q_layernorm.weight", ix.head_dim, zc));
  EXL3_ASSIGN_OR_RETURN(a->index_k_norm_, LoadNormWeight(src, p + "indexer.k_layernorm.weight", ix.head_dim, zc));
  return a;
}

absl::Status QsaAttention::Forward(const float* x, const StepTokens& tokens, PagedKvCache& cache,
                                   AttentionCarry& /*carry*/, float* out, CpuCompute& compute) {
  const int T = tokens.num_tokens, D = cfg_.head_dim, NH = cfg_.num_heads, KV = cfg_.num_kv_heads;
  const int group = NH / KV, IH = indexer_.num_heads, ID = indexer_.head_dim, m = indexer_.compress_ratio;
  const float eps = cfg_.rms_norm_eps;
  std::vector<float> qg(static_cast<size_t>(T) * NH * 2 * D), q(static_cast<size_t>(T) * NH * D),
      gate(q.size()), k(static_cast<size_t>(T) * KV * D), v(k.size()),
      iqk(static_cast<size_t>(T) * (IH + 1) * ID);
  EXL3_RETURN_IF_ERROR(q_.Forward(x, T, qg.data(), compute));
  EXL3_RETURN_IF_ERROR(k_.Forward(x, T, k.data(), compute));
  EXL3_RETURN_IF_ERROR(v_.Forward(x, T, v.data(), compute));
  EXL3_RETURN_IF_ERROR(index_qk_.Forward(x, T, iqk.data(), compute));
  for (size_t th = 0; th < static_cast<size_t>(T) * NH; ++th) {  // per head: query, then gate
    std::copy_n(&qg[th * 2 * D], D, &q[th * D]);
    std::copy_n(&qg[th * 2 * D + D], D, &gate[th * D]);
  }
  RmsNormRows(q.data(), q_norm_.data(), T * NH, D, eps, q.data());
  RmsNormRows(k.data(), k_norm_.data(), T * KV, D, eps, k.data());
  const int kv_floats = 2 * KV * D;
  RopeAngles angles;
  for (int t = 0; t < T; ++t) {
    rope_.Angles(tokens.positions[t], tokens.seq_len_after[t], &angles);
    rope_.Apply(angles, &q[static_cast<size_t>(t) * NH * D], NH, D);
    rope_.Apply(angles, &k[static_cast<size_t>(t) * KV * D], KV, D);
    float* iq = &iqk[static_cast<size_t>(t) * (IH + 1) * ID];  // query heads, then the raw key
    RmsNormRows(iq, index_q_norm_.data(), IH, ID, eps, iq);
    rope_.Apply(angles, iq, IH, ID);
    float* slot = cache.Slot(layer_, tokens.block_table(t), tokens.positions[t]);
    std::copy_n(&k[static_cast<size_t>(t) * KV * D], KV * D, slot);
    std::copy_n(&v[static_cast<size_t>(t) * KV * D], KV * D, slot + KV * D);
    std::copy_n(iq + static_cast<size_t>(IH) * ID, ID, slot + kv_floats);
  }

  // Per chunk run: the block keys its last token sees (earlier tokens see a prefix of them).
  std::vector<int> firsts;
  for (int t = 0; t < T; ++t)
    if (t == 0 || tokens.chunk_of[t] != tokens.chunk_of[t - 1]) firsts.push_back(t);
  firsts.push_back(T);
  std::vector<std::vector<int32_t>> selected(T);
  for (size_t r = 0; r + 1 < firsts.size(); ++r) {
    const int t0 = firsts[r], t1 = firsts[r + 1];
    const std::vector<int32_t>& table = tokens.block_table(t0);
    const int blocks = (tokens.positions[t1 - 1] + 1) / m;
    std::vector<float> block_keys(static_cast<size_t>(blocks) * ID);
    for (int b = 0; b < blocks; ++b) {
      float* kb = &block_keys[static_cast<size_t>(b) * ID];
      for (int i = 0; i < m; ++i) {
        const float* raw = cache.Slot(layer_, table, b * m + i) + kv_floats;
        for (int d = 0; d < ID; ++d) kb[d] += raw[d];
      }
      for (int d = 0; d < ID; ++d) kb[d] /= static_cast<float>(m);
      RmsNorm(kb, index_k_norm_.data(), ID, eps, kb);
      rope_.Apply(kb, 1, ID, b * m, tokens.seq_len_after[t0]);
    }
    compute.ParallelFor(t1 - t0, [&](int i) {
      const int t = t0 + i, pos = tokens.positions[t];
      std::vector<float> scores;
      QsaBlockScores(&iqk[static_cast<size_t>(t) * (IH + 1) * ID], block_keys.data(), (pos + 1) / m, indexer_, &scores);
      selected[t] = QsaSelectedPositions(scores, pos, indexer_);
    });
  }

  std::vector<float> attn(static_cast<size_t>(T) * NH * D);
  const float scale = cfg_.attention_scale;
  compute.ParallelFor(T * NH, [&](int item) {
    const int t = item / NH, h = item % NH, g = h / group;
    const std::vector<int32_t>& table = tokens.block_table(t);
    const std::vector<int32_t>& seen = selected[t];
    const float* qh = &q[(static_cast<size_t>(t) * NH + h) * D];
    std::vector<float> scores(seen.size());
    for (size_t i = 0; i < seen.size(); ++i) {
      const float* kj = cache.Slot(layer_, table, seen[i]) + g * D;
      float s = 0.0f;
      for (int d = 0; d < D; ++d) s += qh[d] * kj[d];
      scores[i] = s * scale;
    }
    SoftmaxInPlace(scores.data(), static_cast<int>(scores.size()));
    float* o = &attn[(static_cast<size_t>(t) * NH + h) * D];
    std::fill_n(o, D, 0.0f);
    for (size_t i = 0; i < seen.size(); ++i) {
      const float* vj = cache.Slot(layer_, table, seen[i]) + KV * D + g * D;
      for (int d = 0; d < D; ++d) o[d] += scores[i] * vj[d];
    }
  });
  for (size_t i = 0; i < attn.size(); ++i) attn[i] *= 1.0f / (1.0f + std::exp(-gate[i]));
  return o_.Forward(attn.data(), T, out, compute);
}

}  // namespace exl3::engine
