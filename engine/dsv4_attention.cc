#include "engine/dsv4_attention.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/rms_norm.h"

namespace exl3::engine {
namespace {

// Rotates the last rope_dim of x's `dim` values, pairs (2i, 2i+1) of that slice, by the angles
// (sign -1: the conjugate rotation, which undoes it).
void RotateTail(const RopeAngles& a, float* x, int dim, int rope_dim, float sign) {
  float* r = x + dim - rope_dim;
  for (int i = 0; i < rope_dim / 2; ++i) {
    const float c = a.cos[i], s = sign * a.sin[i];
    const float x0 = r[2 * i], x1 = r[2 * i + 1];
    r[2 * i] = x0 * c - x1 * s;
    r[2 * i + 1] = x1 * c + x0 * s;
  }
}

// x / rms(x) in place, no weight.
void UnweightedRmsNorm(float* x, int n, float eps) {
  double ss = 0.0;
  for (int i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = static_cast<float>(1.0 / std::sqrt(ss / n + eps));
  for (int i = 0; i < n; ++i) x[i] *= inv;
}

absl::StatusOr<std::vector<float>> LoadMatrix(const TensorSource& src, const std::string& name,
                                              int64_t rows, int64_t cols) {
  EXL3_ASSIGN_OR_RETURN(TensorView t, src.Get(name));
  if (t.info->shape != std::vector<int64_t>{rows, cols})
    return absl::InvalidArgumentError(absl::StrCat(name, ": expected shape [", rows, ", ", cols, "]"));
  return ToFloat32(t);
}

}  // namespace

Dsv4Attention::Dsv4Attention(const ModelConfig& cfg, int layer)
    : cfg_(cfg),
      v4_(*cfg.dsv4),
      layer_(layer),
      type_(cfg.dsv4->layer_types[layer]),
      rate_(cfg.dsv4->CompressRate(layer)),
      slot_(SlotLayoutFor(*cfg.dsv4, cfg.dsv4->layer_types[layer])),
      rope_(cfg.dsv4->layer_types[layer] == Dsv4LayerType::kSlidingWindow ? cfg.dsv4->main_rope
                                                                          : cfg.dsv4->compress_rope,
            cfg.max_position_embeddings) {}

absl::StatusOr<std::unique_ptr<Dsv4Attention>> Dsv4Attention::Load(const ModelConfig& cfg,
                                                                   const TensorSource& src,
                                                                   int layer) {
  std::unique_ptr<Dsv4Attention> a(new Dsv4Attention(cfg, layer));
  const Dsv4Config& v = *cfg.dsv4;
  const int H = cfg.hidden_size, NH = cfg.num_heads, D = v.head_dim, G = v.o_groups,
            R = v.o_lora_rank;
  const std::string p = absl::StrCat("model.layers.", layer, ".attn.");
  EXL3_ASSIGN_OR_RETURN(a->wq_a_, Linear::Load(src, p + "wq_a", H, v.q_lora_rank));
  EXL3_ASSIGN_OR_RETURN(a->q_norm_, LoadVector(src, p + "q_norm.weight", v.q_lora_rank));
  EXL3_ASSIGN_OR_RETURN(a->wq_b_, Linear::Load(src, p + "wq_b", v.q_lora_rank, NH * D));
  EXL3_ASSIGN_OR_RETURN(a->wkv_, Linear::Load(src, p + "wkv", H, D));
  EXL3_ASSIGN_OR_RETURN(a->kv_norm_, LoadVector(src, p + "norm.weight", D));
  EXL3_ASSIGN_OR_RETURN(a->sinks_, LoadVector(src, p + "attn_sink", NH));
  EXL3_ASSIGN_OR_RETURN(a->wo_b_, Linear::Load(src, p + "wo_b", G * R, H));
  // wo_a [G * R, NH * D / G]: group g's rows g R .. (g + 1) R, each group its own layer.
  const int in_per_group = NH * D / G;
  EXL3_ASSIGN_OR_RETURN(Linear wo_a, Linear::Load(src, p + "wo_a", in_per_group, G * R));
  const std::vector<float> w = wo_a.DenseWeight();
  for (int g = 0; g < G; ++g) {
    std::vector<float> rows(w.begin() + static_cast<size_t>(g) * R * in_per_group,
                            w.begin() + static_cast<size_t>(g + 1) * R * in_per_group);
    a->wo_a_.push_back(Linear::FromDense(std::move(rows), in_per_group, R));
  }
  if (a->type_ == Dsv4LayerType::kSlidingWindow) {
    if (src.Has(p + "compressor.ape"))
      return absl::InvalidArgumentError(absl::StrCat(
          p, "compressor.*: layer ", layer, " has compressor weights but layer_types makes it "
          "sliding_attention"));
    return a;
  }
  auto load_compressor = [&](const std::string& q, int dim, int width, int kv_offset,
                             int gate_offset, int entry_offset) -> absl::StatusOr<Compressor> {
    Compressor c;
    c.dim = dim;
    c.width = width;
    c.kv_offset = kv_offset;
    c.gate_offset = gate_offset;
    c.entry_offset = entry_offset;
    EXL3_ASSIGN_OR_RETURN(c.wkv, Linear::Load(src, q + "wkv", H, width));
    EXL3_ASSIGN_OR_RETURN(c.wgate, Linear::Load(src, q + "wgate", H, width));
    EXL3_ASSIGN_OR_RETURN(c.ape, LoadMatrix(src, q + "ape", a->rate_, width));
    EXL3_ASSIGN_OR_RETURN(c.norm, LoadVector(src, q + "norm.weight", dim));
    return c;
  };
  const Dsv4SlotLayout& s = a->slot_;
  EXL3_ASSIGN_OR_RETURN(a->compressor_, load_compressor(p + "compressor.", D, s.comp_width,
                                                        s.comp_kv, s.comp_gate, s.comp_entry));
  if (a->type_ == Dsv4LayerType::kCompressedSparse) {
    Indexer ix;
    EXL3_ASSIGN_OR_RETURN(ix.wq_b, Linear::Load(src, p + "indexer.wq_b", v.q_lora_rank,
                                                v.index_heads * v.index_head_dim));
    EXL3_ASSIGN_OR_RETURN(ix.weights_proj, Linear::Load(src, p + "indexer.weights_proj", H, v.index_heads));
    EXL3_ASSIGN_OR_RETURN(ix.compressor,
                          load_compressor(p + "indexer.compressor.", v.index_head_dim, s.ix_width,
                                          s.ix_kv, s.ix_gate, s.ix_entry));
    a->indexer_ = std::move(ix);
  }
  return a;
}

absl::Status Dsv4Attention::Project(const Compressor& c, const float* x, const StepTokens& tokens,
                                    PagedKvCache& cache, CpuCompute& compute) const {
  const int T = tokens.num_tokens, W = c.width;
  std::vector<float> kv(static_cast<size_t>(T) * W), gate(static_cast<size_t>(T) * W);
  EXL3_RETURN_IF_ERROR(c.wkv.Forward(x, T, kv.data(), compute));
  EXL3_RETURN_IF_ERROR(c.wgate.Forward(x, T, gate.data(), compute));
  for (int t = 0; t < T; ++t) {
    float* slot = cache.Slot(layer_, tokens.block_table(t), tokens.positions[t]);
    const float* ape = &c.ape[static_cast<size_t>(tokens.positions[t] % rate_) * W];
    std::copy_n(&kv[static_cast<size_t>(t) * W], W, slot + c.kv_offset);
    for (int i = 0; i < W; ++i) slot[c.gate_offset + i] = gate[static_cast<size_t>(t) * W + i] + ape[i];
  }
  return absl::OkStatus();
}

void Dsv4Attention::CompressWindow(const Compressor& c, PagedKvCache& cache,
                                   const std::vector<int32_t>& table, int w) const {
  const int m = rate_, dim = c.dim;
  const bool overlapping = c.width == 2 * dim;
  // The window's terms per channel: (slot, channel offset) of window w - 1's first half
  // (overlapping windows, w > 0), then window w (its second half when overlapping).
  std::vector<const float*> slots;
  std::vector<int> channel;
  if (overlapping && w > 0) {
    for (int j = 0; j < m; ++j) {
      slots.push_back(cache.Slot(layer_, table, (w - 1) * m + j));
      channel.push_back(0);
    }
  }
  for (int j = 0; j < m; ++j) {
    slots.push_back(cache.Slot(layer_, table, w * m + j));
    channel.push_back(overlapping ? dim : 0);
  }
  const int n = static_cast<int>(slots.size());
  std::vector<float> entry(dim), weight(n);
  for (int d = 0; d < dim; ++d) {
    float mx = -INFINITY;
    for (int i = 0; i < n; ++i) {
      weight[i] = slots[i][c.gate_offset + channel[i] + d];
      mx = std::max(mx, weight[i]);
    }
    float sum = 0.0f;
    for (int i = 0; i < n; ++i) sum += (weight[i] = std::exp(weight[i] - mx));
    float acc = 0.0f;
    for (int i = 0; i < n; ++i) acc += slots[i][c.kv_offset + channel[i] + d] * (weight[i] / sum);
    entry[d] = acc;
  }
  float* dest = cache.Slot(layer_, table, w * m + m - 1) + c.entry_offset;
  RmsNorm(entry.data(), c.norm.data(), dim, cfg_.rms_norm_eps, dest);
  RopeAngles angles;
  rope_.Angles(w * m, w * m + 1, &angles);
  RotateTail(angles, dest, dim, v4_.rope_dim, 1.0f);
}

absl::Status Dsv4Attention::SelectEntries(const float* x, const std::vector<float>& q_resid,
                                          const StepTokens& tokens, PagedKvCache& cache,
                                          std::vector<std::vector<int32_t>>* entries,
                                          CpuCompute& compute) const {
  const int T = tokens.num_tokens;
  entries->assign(T, {});
  for (int t = 0; t < T; ++t) {
    (*entries)[t].resize((tokens.positions[t] + 1) / rate_);
    std::iota((*entries)[t].begin(), (*entries)[t].end(), 0);
  }
  if (!indexer_) return absl::OkStatus();  // HCA: every closed window

  const Indexer& ix = *indexer_;
  const int NI = v4_.index_heads, DI = v4_.index_head_dim, topk = v4_.index_topk;
  std::vector<float> q(static_cast<size_t>(T) * NI * DI), w(static_cast<size_t>(T) * NI);
  EXL3_RETURN_IF_ERROR(ix.wq_b.Forward(q_resid.data(), T, q.data(), compute));
  EXL3_RETURN_IF_ERROR(ix.weights_proj.Forward(x, T, w.data(), compute));
  const float head_weight = static_cast<float>(1.0 / std::sqrt(static_cast<double>(NI)));
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(DI)));
  compute.ParallelFor(T, [&](int t) {
    std::vector<int32_t>& chosen = (*entries)[t];
    if (static_cast<int>(chosen.size()) <= topk) return;  // it sees no more than top-k: all
    const int pos = tokens.positions[t];
    RopeAngles angles;
    rope_.Angles(pos, tokens.seq_len_after[t], &angles);
    float* qt = &q[static_cast<size_t>(t) * NI * DI];
    for (int h = 0; h < NI; ++h) RotateTail(angles, qt + static_cast<size_t>(h) * DI, DI, v4_.rope_dim, 1.0f);
    const std::vector<int32_t>& table = tokens.block_table(t);
    std::vector<float> score(chosen.size());
    for (size_t e = 0; e < chosen.size(); ++e) {
      const float* k = cache.Slot(layer_, table, static_cast<int>(e) * rate_ + rate_ - 1) +
                       ix.compressor.entry_offset;
      float s = 0.0f;
      for (int h = 0; h < NI; ++h) {
        const float* qh = qt + static_cast<size_t>(h) * DI;
        float dot = 0.0f;
        for (int d = 0; d < DI; ++d) dot += qh[d] * k[d];
        s += std::max(dot, 0.0f) * scale * (w[static_cast<size_t>(t) * NI + h] * head_weight);
      }
      score[e] = s;
    }
    std::partial_sort(chosen.begin(), chosen.begin() + topk, chosen.end(), [&](int32_t a, int32_t b) {
      return score[a] != score[b] ? score[a] > score[b] : a < b;
    });
    chosen.resize(topk);
    std::sort(chosen.begin(), chosen.end());
  });
  return absl::OkStatus();
}

absl::Status Dsv4Attention::Forward(const float* x, const StepTokens& tokens, PagedKvCache& cache,
                                    AttentionCarry& /*carry*/, float* out, CpuCompute& compute) {
  const int T = tokens.num_tokens, NH = cfg_.num_heads, D = v4_.head_dim, RD = v4_.rope_dim;
  const float eps = cfg_.rms_norm_eps;
  std::vector<float> q_resid(static_cast<size_t>(T) * v4_.q_lora_rank), q(static_cast<size_t>(T) * NH * D),
      kv(static_cast<size_t>(T) * D);
  EXL3_RETURN_IF_ERROR(wq_a_.Forward(x, T, q_resid.data(), compute));
  RmsNormRows(q_resid.data(), q_norm_.data(), T, v4_.q_lora_rank, eps, q_resid.data());
  EXL3_RETURN_IF_ERROR(wq_b_.Forward(q_resid.data(), T, q.data(), compute));
  EXL3_RETURN_IF_ERROR(wkv_.Forward(x, T, kv.data(), compute));
  RmsNormRows(kv.data(), kv_norm_.data(), T, D, eps, kv.data());
  std::vector<RopeAngles> angles(T);
  for (int t = 0; t < T; ++t) {
    rope_.Angles(tokens.positions[t], tokens.seq_len_after[t], &angles[t]);
    for (int h = 0; h < NH; ++h) {
      float* qh = &q[(static_cast<size_t>(t) * NH + h) * D];
      UnweightedRmsNorm(qh, D, eps);
      RotateTail(angles[t], qh, D, RD, 1.0f);
    }
    float* k = &kv[static_cast<size_t>(t) * D];
    RotateTail(angles[t], k, D, RD, 1.0f);
    std::copy_n(k, D, cache.Slot(layer_, tokens.block_table(t), tokens.positions[t]) + slot_.kv);
  }

  // Compressors: every token's projections first, then the entries of the windows this step
  // closes (a window's earlier positions may be in this step too), then the indexer.
  std::vector<std::vector<int32_t>> entries(T);
  if (compressor_) {
    EXL3_RETURN_IF_ERROR(Project(*compressor_, x, tokens, cache, compute));
    if (indexer_) EXL3_RETURN_IF_ERROR(Project(indexer_->compressor, x, tokens, cache, compute));
    std::vector<int> closing;
    for (int t = 0; t < T; ++t)
      if (tokens.positions[t] % rate_ == rate_ - 1) closing.push_back(t);
    compute.ParallelFor(static_cast<int>(closing.size()), [&](int i) {
      const int t = closing[i];
      const int w = tokens.positions[t] / rate_;
      CompressWindow(*compressor_, cache, tokens.block_table(t), w);
      if (indexer_) CompressWindow(indexer_->compressor, cache, tokens.block_table(t), w);
    });
    EXL3_RETURN_IF_ERROR(SelectEntries(x, q_resid, tokens, cache, &entries, compute));
  }

  std::vector<float> attn(static_cast<size_t>(T) * NH * D);
  const float scale = cfg_.attention_scale;
  compute.ParallelFor(T * NH, [&](int item) {
    const int t = item / NH, h = item % NH;
    const int pos = tokens.positions[t];
    const int first = FirstVisiblePosition(pos, v4_.sliding_window);
    const std::vector<int32_t>& table = tokens.block_table(t);
    // The keys (= values) it sees: its window's kv, then its compressed entries.
    std::vector<const float*> keys;
    for (int j = first; j <= pos; ++j) keys.push_back(cache.Slot(layer_, table, j) + slot_.kv);
    for (int32_t e : entries[t])
      keys.push_back(cache.Slot(layer_, table, e * rate_ + rate_ - 1) + slot_.comp_entry);
    const float* qh = &q[(static_cast<size_t>(t) * NH + h) * D];
    const int n = static_cast<int>(keys.size());
    std::vector<float> p(n + 1);
    for (int i = 0; i < n; ++i) {
      float s = 0.0f;
      for (int d = 0; d < D; ++d) s += qh[d] * keys[i][d];
      p[i] = s * scale;
    }
    p[n] = sinks_[h];  // the sink takes its share of the softmax and gives no value
    SoftmaxInPlace(p.data(), n + 1);
    float* o = &attn[(static_cast<size_t>(t) * NH + h) * D];
    std::fill_n(o, D, 0.0f);
    for (int i = 0; i < n; ++i)
      for (int d = 0; d < D; ++d) o[d] += p[i] * keys[i][d];
    RotateTail(angles[t], o, D, RD, -1.0f);
  });

  // Grouped output projection.
  const int G = v4_.o_groups, R = v4_.o_lora_rank, in_per_group = NH * D / G;
  std::vector<float> group_in(static_cast<size_t>(T) * in_per_group), group_out(static_cast<size_t>(T) * R),
      low_rank(static_cast<size_t>(T) * G * R);
  for (int g = 0; g < G; ++g) {
    for (int t = 0; t < T; ++t)
      std::copy_n(&attn[static_cast<size_t>(t) * NH * D + static_cast<size_t>(g) * in_per_group],
                  in_per_group, &group_in[static_cast<size_t>(t) * in_per_group]);
    EXL3_RETURN_IF_ERROR(wo_a_[g].Forward(group_in.data(), T, group_out.data(), compute));
    for (int t = 0; t < T; ++t)
      std::copy_n(&group_out[static_cast<size_t>(t) * R], R,
                  &low_rank[static_cast<size_t>(t) * G * R + static_cast<size_t>(g) * R]);
  }
  return wo_b_.Forward(low_rank.data(), T, out, compute);
}

}  // namespace exl3::engine
