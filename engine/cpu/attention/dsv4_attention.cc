#include "engine/cpu/attention/dsv4_attention.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cpu/attention/dsv4_grouped_wo_a.h"
#include "engine/cpu/rms_norm.h"
#include "engine/cpu/sequence_state.h"

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
  EXL3_ASSIGN_OR_RETURN(const std::vector<float> w, LoadGroupedWoA(src, p + "wo_a", G, R, in_per_group));
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
  auto load_compressor = [&](const std::string& q, int dim, int width) -> absl::StatusOr<Compressor> {
    Compressor c;
    c.dim = dim;
    c.width = width;
    EXL3_ASSIGN_OR_RETURN(c.wkv, Linear::Load(src, q + "wkv", H, width));
    EXL3_ASSIGN_OR_RETURN(c.wgate, Linear::Load(src, q + "wgate", H, width));
    EXL3_ASSIGN_OR_RETURN(c.ape, LoadMatrix(src, q + "ape", a->rate_, width));
    EXL3_ASSIGN_OR_RETURN(c.norm, LoadVector(src, q + "norm.weight", dim));
    return c;
  };
  const bool overlapping = a->type_ == Dsv4LayerType::kCompressedSparse;
  EXL3_ASSIGN_OR_RETURN(a->compressor_, load_compressor(p + "compressor.", D, (overlapping ? 2 : 1) * D));
  if (a->type_ == Dsv4LayerType::kCompressedSparse) {
    Indexer ix;
    EXL3_ASSIGN_OR_RETURN(ix.wq_b, Linear::Load(src, p + "indexer.wq_b", v.q_lora_rank,
                                                v.index_heads * v.index_head_dim));
    EXL3_ASSIGN_OR_RETURN(ix.weights_proj, Linear::Load(src, p + "indexer.weights_proj", H, v.index_heads));
    EXL3_ASSIGN_OR_RETURN(ix.compressor,
                          load_compressor(p + "indexer.compressor.", v.index_head_dim, 2 * v.index_head_dim));
    a->indexer_ = std::move(ix);
  }
  return a;
}

absl::Status Dsv4Attention::Project(const Compressor& c, const float* x, const StepTokens& tokens,
                                    Projections* out, CpuCompute& compute) const {
  const int T = tokens.num_tokens, W = c.width;
  out->kv.resize(static_cast<size_t>(T) * W);
  out->gate.resize(static_cast<size_t>(T) * W);
  EXL3_RETURN_IF_ERROR(c.wkv.Forward(x, T, out->kv.data(), compute));
  EXL3_RETURN_IF_ERROR(c.wgate.Forward(x, T, out->gate.data(), compute));
  for (int t = 0; t < T; ++t) {
    const float* ape = &c.ape[static_cast<size_t>(tokens.positions[t] % rate_) * W];
    float* g = &out->gate[static_cast<size_t>(t) * W];
    for (int i = 0; i < W; ++i) g[i] += ape[i];
  }
  return absl::OkStatus();
}

namespace {

// A running softmax over `n` channels: log-sum-exp of the logits seen, then the softmax-weighted
// mean of the values seen ([2, n]). Empty: log-sum-exp -inf, mean 0.
void ClearAccumulator(float* acc, int n) {
  std::fill_n(acc, n, -INFINITY);
  std::fill_n(acc + n, n, 0.0f);
}

void FoldIntoAccumulator(float* acc, int n, const float* value, const float* logit) {
  float* lse = acc;
  float* mean = acc + n;
  for (int i = 0; i < n; ++i) {
    const float g = logit[i], old = lse[i];
    if (old == -INFINITY) {
      lse[i] = g;
      mean[i] = value[i];
      continue;
    }
    const float hi = std::max(old, g), lo = std::min(old, g);
    const float merged = hi + std::log1p(std::exp(lo - hi));
    mean[i] = mean[i] * std::exp(old - merged) + value[i] * std::exp(g - merged);
    lse[i] = merged;
  }
}

}  // namespace

void Dsv4Attention::FoldPosition(const Compressor& c, const Projections& proj, int t, int position,
                                 float* area) const {
  const int d = c.dim, W = c.width, m = rate_, j = position % m;
  const float* kv = &proj.kv[static_cast<size_t>(t) * W];
  const float* gate = &proj.gate[static_cast<size_t>(t) * W];
  float* current = area + c.cache.current;
  if (c.cache.overlapping) {
    // The first half of window w's channels starts entry w + 1, the second half ends entry w
    // (which window w - 1's first half started).
    float* next = area + c.cache.next;
    if (j == 0) {
      std::copy_n(next, 2 * d, current);
      ClearAccumulator(next, d);
    }
    FoldIntoAccumulator(current, d, kv + d, gate + d);
    FoldIntoAccumulator(next, d, kv, gate);
  } else {
    if (j == 0) ClearAccumulator(current, d);
    FoldIntoAccumulator(current, d, kv, gate);
  }
  if (j != m - 1) return;
  const int w = position / m, block_size = layout_block_size_;
  float* dest = area + c.cache.entries + static_cast<size_t>((position % block_size) / m) * d;
  RmsNorm(current + d, c.norm.data(), d, cfg_.rms_norm_eps, dest);
  RopeAngles angles;
  rope_.Angles(w * m, w * m + 1, &angles);
  RotateTail(angles, dest, d, v4_.rope_dim, 1.0f);
}

absl::Status Dsv4Attention::Fold(int t0, int t1, const StepTokens& tokens, PagedKvCache& cache,
                                 const Projections& comp, const Projections* ix) {
  const int B = layout_block_size_;
  const SequenceChunk& chunk = tokens.batch->chunks[tokens.chunk_of[t0]];
  const std::vector<int32_t>& table = chunk.block_table;
  const int accumulator_floats = layout_.accumulators_end - (layout_.folded + 1);
  // A verify chunk's rows: its last sampled token and drafts, t1 - rows .. t1 - 1.
  const int rows = KeptStatesOf(chunk);
  bool folding = false;  // this run of the chunk has folded a position
  for (int t = t0; t < t1; ++t) {
    const int pos = tokens.positions[t], local = pos % B;
    float* area = cache.BlockArea(layer_, table, pos);
    const int folded = static_cast<int>(area[layout_.folded]);
    bool restored = false;  // the accumulators for this position came from the kept ones
    if (local == 0) {
      // A block starts from its predecessor's state after that block's last position (from
      // empty accumulators at position 0); whatever the block held before is overwritten.
      if (pos == 0) {
        ClearAccumulator(area + compressor_->cache.current, compressor_->dim);
        if (compressor_->cache.overlapping) ClearAccumulator(area + compressor_->cache.next, compressor_->dim);
        if (indexer_) {
          const Compressor& k = indexer_->compressor;
          ClearAccumulator(area + k.cache.current, k.dim);
          ClearAccumulator(area + k.cache.next, k.dim);
        }
      } else {
        const float* prev = cache.BlockArea(layer_, table, pos - 1);
        if (static_cast<int>(prev[layout_.folded]) != B)
          return absl::InternalError(absl::StrCat(
              "layer ", layer_, ": the cache block of positions [", pos - B, ", ", pos, ") holds ",
              static_cast<int>(prev[layout_.folded]), " folded positions, not ", B,
              ": its compressor state cannot be continued"));
        std::copy(prev + layout_.folded + 1, prev + layout_.accumulators_end, area + layout_.folded + 1);
      }
    } else if (local < folded) {
      // The block went past this position: drafts the scheduler rejected (their verify chunk
      // kept the state before them), or else an earlier run of this same step (a failed step
      // run again), whose folds stand.
      const float* kept = kept_.Find(chunk.state_slot, chunk.sequence_id, pos, table[pos / B]);
      if (kept == nullptr) continue;
      std::copy_n(kept, accumulator_floats, area + layout_.folded + 1);
      area[layout_.folded] = static_cast<float>(local);
      restored = true;
    } else if (local > folded) {
      return absl::InternalError(absl::StrCat("layer ", layer_, ": position ", pos, " follows only ",
                                              folded, " folded positions of its cache block"));
    }
    if (!folding) {
      kept_.Begin(chunk.state_slot, chunk.sequence_id);  // what the slot kept is folded over now
      folding = true;
      // This chunk run again (a failed step's retry) after its first run kept states: it skipped
      // the positions that run folded up to the first it kept a state for, after a row of this
      // chunk; keep that state again, as the first run did (else a resume there finds nothing).
      if (restored && t > t0 && t - 1 >= t1 - rows)
        kept_.Keep(chunk.state_slot, pos, table[pos / B], area + layout_.folded + 1);
    }
    FoldPosition(*compressor_, comp, t, pos, area);
    if (indexer_) FoldPosition(indexer_->compressor, *ix, t, pos, area);
    area[layout_.folded] = static_cast<float>(local + 1);
    // A later chunk may resume after any row but the last (the live state); at a block's end
    // the next block's start continues from this one's full state.
    if (t >= t1 - rows && t + 1 < t1 && local + 1 < B)
      kept_.Keep(chunk.state_slot, pos + 1, table[pos / B], area + layout_.folded + 1);
  }
  return absl::OkStatus();
}

const float* Dsv4Attention::Entry(const Compressor& c, PagedKvCache& cache,
                                  const std::vector<int32_t>& table, int w) const {
  const int last = w * rate_ + rate_ - 1;
  return cache.BlockArea(layer_, table, last) + c.cache.entries +
         static_cast<size_t>((last % layout_block_size_) / rate_) * c.dim;
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
      const float* k = Entry(ix.compressor, cache, table, static_cast<int>(e));
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

absl::Status Dsv4Attention::UseCacheShape(const KvCacheShape& shape) {
  if (layout_block_size_ != shape.block_size) {  // the cache's blocks decide the areas
    layout_block_size_ = shape.block_size;
    layout_ = CacheLayoutFor(v4_, type_, layout_block_size_);
    if (compressor_) compressor_->cache = layout_.compressor;
    if (indexer_) indexer_->compressor.cache = layout_.indexer;
  }
  if (!compressor_ || (kept_shape_.block_size == shape.block_size && kept_shape_.num_blocks == shape.num_blocks &&
                       kept_shape_.num_sequence_slots == shape.num_sequence_slots &&
                       kept_shape_.max_logit_rows_per_chunk == shape.max_logit_rows_per_chunk))
    return absl::OkStatus();
  EXL3_RETURN_IF_ERROR(kept_.Allocate(shape.num_sequence_slots, shape.max_logit_rows_per_chunk - 1,
                                      layout_.accumulators_end - (layout_.folded + 1)));
  kept_shape_ = shape;
  return absl::OkStatus();
}

absl::Status Dsv4Attention::Forward(const float* x, const StepTokens& tokens, PagedKvCache& cache,
                                    AttentionCarry& carry, float* out, CpuCompute& compute) {
  const int T = tokens.num_tokens, NH = cfg_.num_heads, D = v4_.head_dim, RD = v4_.rope_dim;
  const float eps = cfg_.rms_norm_eps;
  EXL3_RETURN_IF_ERROR(UseCacheShape(cache.shape()));
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
    std::copy_n(k, D, cache.Slot(layer_, tokens.block_table(t), tokens.positions[t]));
  }

  // Compressors: every token's projections, folded chunk by chunk in position order (the
  // chunks in parallel), closing windows on the way; then the indexer.
  std::vector<std::vector<int32_t>> entries(T);
  if (compressor_) {
    for (const SequenceChunk& c : tokens.batch->chunks) {
      const int kept_states = KeptStatesOf(c) - 1;  // besides the live state in the block area
      const bool verify = kept_states > 0;
      if (!verify && !kept_.enabled()) continue;  // plain decoding: nothing kept, no slot read
      if (kept_states > kept_.max_kept() || c.state_slot < 0 || c.state_slot >= kept_.num_slots())
        return absl::InternalError(absl::StrCat(
            "sequence ", c.sequence_id, ": a ", verify ? "verify " : "", "chunk of ", c.num_logit_rows,
            " rows in state slot ", c.state_slot,
            ", for a cache of ", kept_.num_slots(), " slots keeping at most ", kept_.max_kept(),
            " compressor states per verify chunk (KvCacheShape::max_logit_rows_per_chunk - 1)"));
    }
    Projections comp, ix;
    EXL3_RETURN_IF_ERROR(Project(*compressor_, x, tokens, &comp, compute));
    if (indexer_) EXL3_RETURN_IF_ERROR(Project(indexer_->compressor, x, tokens, &ix, compute));
    std::vector<int> chunk_start;  // first token of each chunk, then T
    for (int t = 0; t < T; ++t)
      if (t == 0 || tokens.chunk_of[t] != tokens.chunk_of[t - 1]) chunk_start.push_back(t);
    chunk_start.push_back(T);
    const int chunks = static_cast<int>(chunk_start.size()) - 1;
    std::vector<absl::Status> folded(chunks);
    compute.ParallelFor(chunks, [&](int c) {
      folded[c] = Fold(chunk_start[c], chunk_start[c + 1], tokens, cache, comp, indexer_ ? &ix : nullptr);
    });
    for (const absl::Status& st : folded) EXL3_RETURN_IF_ERROR(st);
    EXL3_RETURN_IF_ERROR(SelectEntries(x, q_resid, tokens, cache, &entries, compute));
    // The CSA choice, as DSA layers leave theirs (no later V4 layer reads it; tests compare it).
    if (indexer_) carry.topk = TopkSelection{entries};
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
    for (int j = first; j <= pos; ++j) keys.push_back(cache.Slot(layer_, table, j));
    for (int32_t e : entries[t]) keys.push_back(Entry(*compressor_, cache, table, e));
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
