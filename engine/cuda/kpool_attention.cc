#include "engine/cuda/kpool_attention.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cuda/dsa_indexer_kernels.h"
#include "engine/cuda/kpool_indexer_kernels.h"
#include "engine/cuda/weight_upload.h"
#include "engine/config/glm5next_config.h"
#include "model/moe_config.h"

namespace exl3::engine::cuda {
namespace {

constexpr float kIndexerNormEps = 1e-6f;  // the indexer's k_norm (engine/cpu/attention/kpool_dsa_attention.cc)
// Floats of pool scores held at once (64 MiB): a prefill step scores its tokens in groups.
constexpr int64_t kScoreBudgetFloats = int64_t{16} << 20;
// A decode graph's bucket is at most this many tokens: its scores always fit one group.
constexpr int kMinScoreRows = 64;
constexpr int kMaxScoreRows = 32768;  // the score kernel's grid holds at most 65535 tokens

int PoolOf(const ModelConfig& cfg) { return cfg.glm5next->index_kpool; }
int SelectPoolsOf(const ModelConfig& cfg) { return cfg.indexer.topk / cfg.glm5next->index_kpool; }

// Elements per token of KpoolWorkspace's per-token buffers (pool_count and selected_count: 1).
struct KpoolRowWidths {
  size_t index_q, index_k, index_w, pools, selected;  // index_k: the gate's too
};

KpoolRowWidths RowWidthsOf(const ModelConfig& cfg) {
  const size_t NI = cfg.indexer.num_heads, DI = cfg.indexer.head_dim;
  const size_t P = PoolOf(cfg), select = SelectPoolsOf(cfg);
  return KpoolRowWidths{NI * DI, DI, NI, select, select * P + P};
}

}  // namespace

absl::Status KpoolWorkspace::Reserve(const ModelConfig& cfg, int T, int max_context, bool* moved) {
  const size_t t = static_cast<size_t>(std::max(T, 1));
  const KpoolRowWidths w = RowWidthsOf(cfg);
  score_length = std::max(max_context / PoolOf(cfg), 1);
  const int64_t rows = std::min<int64_t>(kMaxScoreRows, std::max<int64_t>(kMinScoreRows, kScoreBudgetFloats / score_length));
  score_rows = static_cast<int>(std::min<int64_t>(rows, std::max(T, 1)));
  stride = static_cast<int>(w.selected);
  struct FloatNeed {
    DeviceArray<float>* a;
    size_t n;
  };
  struct IntNeed {
    DeviceArray<int32_t>* a;
    size_t n;
  };
  const std::vector<FloatNeed> floats = {{&index_q, t * w.index_q},
                                         {&index_k, t * w.index_k},
                                         {&index_gate, t * w.index_k},
                                         {&index_w, t * w.index_w},
                                         {&scores, static_cast<size_t>(score_rows) * score_length}};
  const std::vector<IntNeed> ints = {
      {&pools, t * w.pools}, {&pool_count, t}, {&selected, t * w.selected}, {&selected_count, t}};
  *moved = false;
  for (const FloatNeed& n : floats) *moved |= n.a->size() < n.n;
  for (const IntNeed& n : ints) *moved |= n.a->size() < n.n;
  if (!*moved) return absl::OkStatus();
  for (const FloatNeed& n : floats) EXL3_RETURN_IF_ERROR(n.a->Reserve(n.n));
  for (const IntNeed& n : ints) EXL3_RETURN_IF_ERROR(n.a->Reserve(n.n));
  return absl::OkStatus();
}

KpoolWorkspace::Rows KpoolWorkspace::RowsFrom(const ModelConfig& cfg, int row) const {
  const KpoolRowWidths w = RowWidthsOf(cfg);
  const size_t r = static_cast<size_t>(row);
  return Rows{index_q.get() + r * w.index_q, index_k.get() + r * w.index_k, index_gate.get() + r * w.index_k,
              index_w.get() + r * w.index_w,   pools.get() + r * w.pools,     pool_count.get() + r,
              selected.get() + r * w.selected, selected_count.get() + r};
}

absl::StatusOr<std::unique_ptr<CudaKpoolAttention>> CudaKpoolAttention::Load(const ModelConfig& cfg,
                                                                             const TensorSource& src, int layer) {
  if (cfg.attention != AttentionKind::kPooledDsa || cfg.glm5next == nullptr)
    return absl::InvalidArgumentError("CudaKpoolAttention: not a GLM-5.3-Flash model");
  if (cfg.IsLinearAttentionLayer(layer))
    return absl::InvalidArgumentError(absl::StrCat("CudaKpoolAttention: layer ", layer, " is a KDA layer"));
  std::unique_ptr<CudaKpoolAttention> a(new CudaKpoolAttention(cfg, layer));
  EXL3_ASSIGN_OR_RETURN(a->latent_, CudaLatentAttention::Load(cfg, src, layer));
  const std::string p = LayerPrefix(cfg.moe, layer) + "self_attn.indexer.";
  const bool has_tensors = src.Has(p + "wk.weight") || src.Has(p + "wk.trellis");
  if (!cfg.HasOwnIndexer(layer)) {
    if (has_tensors)
      return absl::InvalidArgumentError(
          absl::StrCat(p, "*: layer ", layer, " has indexer weights but config.json marks it shared"));
    bool earlier = false;
    for (int l = 0; l < layer; ++l) earlier |= cfg.HasOwnIndexer(l);
    if (!earlier)
      return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " shares the pooled selection of an earlier "
                                                     "layer, and no earlier layer runs an indexer"));
    return a;
  }
  if (cfg.q_lora_rank <= 0)
    return absl::InvalidArgumentError(absl::StrCat(p, "wq_b: the indexer reads q_a_proj's output (q_lora_rank 0)"));
  const int H = cfg.hidden_size, NI = cfg.indexer.num_heads, DI = cfg.indexer.head_dim, P = PoolOf(cfg);
  if (P < 1 || cfg.indexer.topk < P || cfg.indexer.topk % P != 0)
    return absl::InvalidArgumentError(absl::StrCat(p, ": index_topk ", cfg.indexer.topk,
                                                   " is not a positive multiple of index_kpool ", P));
  Indexer in;
  EXL3_ASSIGN_OR_RETURN(in.wq_b, CudaLinear::Load(src, p + "wq_b", cfg.q_lora_rank, NI * DI));
  EXL3_ASSIGN_OR_RETURN(in.wk, CudaLinear::Load(src, p + "wk", H, DI));
  EXL3_ASSIGN_OR_RETURN(in.weights_proj, CudaLinear::Load(src, p + "weights_proj", H, NI));
  EXL3_ASSIGN_OR_RETURN(in.k_norm_weight, UploadVector(src, p + "k_norm.weight", DI));
  EXL3_ASSIGN_OR_RETURN(in.k_norm_bias, UploadVector(src, p + "k_norm.bias", DI));
  const std::string gate = p + "index_kpool_compress_gate", ape = p + "index_kpool_compress_ape";
  EXL3_ASSIGN_OR_RETURN(TensorView g, src.Get(gate));
  if (g.info->shape != std::vector<int64_t>{DI, H})
    return absl::InvalidArgumentError(absl::StrCat(gate, ": expected shape [", DI, ", ", H, "]"));
  EXL3_ASSIGN_OR_RETURN(std::vector<float> gw, ToFloat32(g));
  EXL3_ASSIGN_OR_RETURN(in.compress_gate, CudaLinear::UploadDense(gw.data(), H, DI));
  EXL3_ASSIGN_OR_RETURN(TensorView e, src.Get(ape));
  if (e.info->shape != std::vector<int64_t>{P, DI})
    return absl::InvalidArgumentError(
        absl::StrCat(ape, ": expected shape [", P, ", ", DI, "] (index_kpool, index_head_dim)"));
  EXL3_ASSIGN_OR_RETURN(std::vector<float> ew, ToFloat32(e));
  EXL3_RETURN_IF_ERROR(in.ape.Upload(ew));
  a->indexer_ = std::move(in);
  return a;
}

int64_t CudaKpoolAttention::weight_bytes() const {
  int64_t b = latent_->weight_bytes();
  if (indexer_) {
    b += indexer_->wq_b.weight_bytes() + indexer_->wk.weight_bytes() + indexer_->weights_proj.weight_bytes() +
         indexer_->compress_gate.weight_bytes();
  }
  return b;
}

std::vector<const CudaLinear*> CudaKpoolAttention::linears() const {
  std::vector<const CudaLinear*> v = latent_->linears();
  if (indexer_) {
    v.push_back(&indexer_->wq_b);
    v.push_back(&indexer_->wk);
    v.push_back(&indexer_->weights_proj);
    v.push_back(&indexer_->compress_gate);
  }
  return v;
}

absl::Status CudaKpoolAttention::Forward(const float* x, int T, const LatentStep& step, KvHalf* cache_layer,
                                         LatentWorkspace& latent_ws, KpoolWorkspace& ws, const CudaLinearContext& ctx,
                                         float* out) const {
  EXL3_RETURN_IF_ERROR(latent_->ProjectAndCache(x, T, step, cache_layer, latent_ws, ctx));
  if (indexer_) EXL3_RETURN_IF_ERROR(Select(x, T, step, cache_layer, latent_ws, ws, ctx));
  const KpoolWorkspace::Rows w = ws.RowsFrom(cfg_, step.first_row);
  LatentSelection selection;
  selection.positions = w.selected;
  selection.count = w.selected_count;
  selection.stride = ws.stride;
  return latent_->AttendAndProject(T, step, cache_layer, &selection, latent_ws, ctx, out);
}

absl::Status CudaKpoolAttention::Select(const float* x, int T, const LatentStep& step, KvHalf* cache_layer,
                                        const LatentWorkspace& latent_ws, KpoolWorkspace& ws,
                                        const CudaLinearContext& ctx) const {
  const Indexer& in = *indexer_;
  const int NI = cfg_.indexer.num_heads, DI = cfg_.indexer.head_dim, P = PoolOf(cfg_), select = SelectPoolsOf(cfg_);
  StreamHandle stream = ctx.stream;
  const KpoolWorkspace::Rows w = ws.RowsFrom(cfg_, step.first_row);
  const float* q_resid = latent_ws.RowsFrom(cfg_, step.first_row, step.splits).q_resid;
  EXL3_RETURN_IF_ERROR(in.wq_b.Forward(q_resid, T, w.index_q, ctx));
  EXL3_RETURN_IF_ERROR(in.wk.Forward(x, T, w.index_k, ctx));
  EXL3_RETURN_IF_ERROR(in.compress_gate.Forward(x, T, w.index_gate, ctx));
  EXL3_RETURN_IF_ERROR(in.weights_proj.Forward(x, T, w.index_w, ctx));
  EXL3_RETURN_IF_ERROR(LayerNormRows(w.index_k, in.k_norm_weight.get(), in.k_norm_bias.get(), T, DI,
                                     kIndexerNormEps, stream));
  const int width = cfg_.KvWidth(layer_), key_offset = cfg_.kv_lora_rank;  // k_i and the gate after the latent
  EXL3_RETURN_IF_ERROR(WriteRowsToCache(w.index_k, T, DI, step.slot, cache_layer, width, key_offset, stream));
  EXL3_RETURN_IF_ERROR(
      WriteRowsToCache(w.index_gate, T, DI, step.slot, cache_layer, width, key_offset + DI, stream));

  const float head_weight = static_cast<float>(1.0 / std::sqrt(static_cast<double>(NI)));
  const float scale = 1.0f / std::sqrt(static_cast<float>(DI));  // as engine/cpu/attention/kpool_indexer.cc
  const KpoolIndexerShape shape{NI, DI, P, width, key_offset};
  // The score rows hold a group of this call's tokens at a time (consumed by the group's top-k).
  for (int t0 = 0; t0 < T; t0 += ws.score_rows) {
    const int n = std::min(ws.score_rows, T - t0);
    // Enough blocks to fill the GPU a few times over; each loops over its token's pools.
    const int tiles = (ws.score_length + kKpoolScorePoolTile - 1) / kKpoolScorePoolTile;
    const int blocks = std::max(1, std::min(tiles, 4 * step.sm_count / n));
    EXL3_RETURN_IF_ERROR(KpoolScores(w.index_q, w.index_w, head_weight, scale, in.ape.get(), cache_layer, step.tokens,
                                     shape, t0, n, blocks, ws.scores.get(), ws.score_length, stream));
    EXL3_RETURN_IF_ERROR(IndexerTopk(ws.scores.get(), ws.score_length, step.tokens.position, t0, n, select, w.pools,
                                     w.pool_count, stream, P));
  }
  return KpoolSelectedPositions(w.pools, w.pool_count, select, step.tokens.position, P, T, w.selected,
                                w.selected_count, ws.stride, stream);
}

}  // namespace exl3::engine::cuda
