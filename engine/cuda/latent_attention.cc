#include "engine/cuda/latent_attention.h"

#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cuda/cublas_status.h"
#include "engine/cuda/dsa_indexer_kernels.h"
#include "engine/cuda/engine_kernels.h"
#include "engine/cuda/weight_upload.h"
#include "engine/cpu/linear.h"

namespace exl3::engine::cuda {
namespace {

// The indexer's k_norm is a LayerNorm with eps 1e-6 (engine/cpu/attention/dsa_attention.cc); q_a_layernorm and
// kv_a_layernorm use cfg.latent_norm_eps, as engine/cpu/attention/mla_attention.cc.
constexpr float kIndexerNormEps = 1e-6f;
// Floats of index scores held at once (128 MiB): a prefill step scores its tokens in groups.
constexpr int64_t kScoreBudgetFloats = int64_t{32} << 20;
// A decode graph's bucket is at most this many tokens: its scores always fit one group.
constexpr int kMinScoreRows = 64;
constexpr int kMaxScoreRows = 32768;  // the score kernel's grid holds at most 65535 tokens

// Elements per token of LatentWorkspace's per-token buffers (but the split-K scratch); the DSA
// indexer's 0 on other models.
struct LatentRowWidths {
  size_t q_resid, q, ckv, latent, attn, index_q, index_k, index_w, selected;
};

LatentRowWidths RowWidthsOf(const ModelConfig& cfg) {
  const size_t NH = cfg.num_heads, R = cfg.kv_lora_rank, rope = cfg.qk_rope_head_dim;
  LatentRowWidths w{};
  w.q_resid = static_cast<size_t>(std::max(cfg.q_lora_rank, 1));
  w.q = NH * (cfg.qk_nope_head_dim + rope);
  w.ckv = R + rope;
  w.latent = NH * R;  // q_latent and o_latent
  w.attn = NH * cfg.v_head_dim;
  if (cfg.attention == AttentionKind::kDsa) {
    const size_t NI = cfg.indexer.num_heads, DI = cfg.indexer.head_dim;
    w.index_q = NI * DI;
    w.index_k = DI;
    w.index_w = NI;
    w.selected = cfg.indexer.topk;
  }
  return w;
}

}  // namespace

absl::Status LatentWorkspace::Reserve(const ModelConfig& cfg, int T, int splits, int max_context, bool* moved) {
  const size_t t = static_cast<size_t>(std::max(T, 1));
  const LatentRowWidths w = RowWidthsOf(cfg);
  struct Need {
    DeviceArray<float>* a;
    size_t n;
  };
  std::vector<Need> needs = {{&q_resid, t * w.q_resid},
                             {&q, t * w.q},
                             {&ckv, t * w.ckv},
                             {&q_latent, t * w.latent},
                             {&o_latent, t * w.latent},
                             {&attn, t * w.attn},
                             {&scratch, static_cast<size_t>(std::max<int64_t>(
                                            LatentAttentionScratchFloats(T, cfg.num_heads, cfg.kv_lora_rank, splits), 1))}};
  size_t select_ints = 0;
  if (cfg.attention == AttentionKind::kDsa) {
    score_length = std::max(max_context, 1);
    const int64_t rows = std::min<int64_t>(kMaxScoreRows, std::max<int64_t>(kMinScoreRows, kScoreBudgetFloats / score_length));
    score_rows = static_cast<int>(std::min<int64_t>(rows, std::max(T, 1)));
    needs.push_back({&index_q, t * w.index_q});
    needs.push_back({&index_k, t * w.index_k});
    needs.push_back({&index_w, t * w.index_w});
    needs.push_back({&scores, static_cast<size_t>(score_rows) * score_length});
    select_ints = t * w.selected;
  }
  *moved = selected.size() < select_ints || selected_count.size() < (select_ints > 0 ? t : 0);
  for (const Need& n : needs) *moved |= n.a->size() < n.n;
  if (!*moved) return absl::OkStatus();
  for (const Need& n : needs) EXL3_RETURN_IF_ERROR(n.a->Reserve(n.n));
  if (select_ints > 0) {
    EXL3_RETURN_IF_ERROR(selected.Reserve(select_ints));
    EXL3_RETURN_IF_ERROR(selected_count.Reserve(t));
  }
  return absl::OkStatus();
}

LatentWorkspace::Rows LatentWorkspace::RowsFrom(const ModelConfig& cfg, int row, int splits) const {
  const LatentRowWidths w = RowWidthsOf(cfg);
  const size_t r = static_cast<size_t>(row);
  Rows rows{};
  rows.q_resid = q_resid.get() + r * w.q_resid;
  rows.q = q.get() + r * w.q;
  rows.ckv = ckv.get() + r * w.ckv;
  rows.q_latent = q_latent.get() + r * w.latent;
  rows.o_latent = o_latent.get() + r * w.latent;
  rows.attn = attn.get() + r * w.attn;
  rows.scratch = scratch.get() + LatentAttentionScratchFloats(row, cfg.num_heads, cfg.kv_lora_rank, splits);
  if (cfg.attention == AttentionKind::kDsa) {
    rows.index_q = index_q.get() + r * w.index_q;
    rows.index_k = index_k.get() + r * w.index_k;
    rows.index_w = index_w.get() + r * w.index_w;
    rows.selected = selected.get() + r * w.selected;
    rows.selected_count = selected_count.get() + r;
  }
  return rows;
}

LatentStep LatentStepOf(const CudaStep& step, int first) {
  const size_t r = static_cast<size_t>(first), half = static_cast<size_t>(step.rotary_half);
  LatentStep ls;
  ls.tokens = step.attention_tokens(first);
  ls.slot = step.slot + r;
  ls.cos = step.cos + r * half;
  ls.sin = step.sin + r * half;
  ls.splits = step.splits;
  ls.split_positions = step.split_positions;
  ls.sm_count = step.sm_count;
  ls.kernel = step.tensor_core_prefill ? LatentKernel::kTensorCores : LatentKernel::kCudaCores;
  ls.first_row = first;
  return ls;
}

absl::StatusOr<std::unique_ptr<CudaLatentAttention>> CudaLatentAttention::Load(const ModelConfig& cfg,
                                                                               const TensorSource& src, int layer) {
  const bool nope_only = cfg.attention == AttentionKind::kPooledDsa;  // GLM-5.3-Flash's indexed layers
  if (!cfg.IsLatentAttention() && !nope_only)
    return absl::InvalidArgumentError("CudaLatentAttention: not a latent-attention model");
  std::unique_ptr<CudaLatentAttention> a(new CudaLatentAttention(cfg, layer));
  const std::string p = LayerPrefix(cfg.moe, layer) + "self_attn.";
  const int H = cfg.hidden_size, NH = cfg.num_heads, R = cfg.kv_lora_rank;
  const int nope = cfg.qk_nope_head_dim, rope = cfg.qk_rope_head_dim, vd = cfg.v_head_dim, qd = nope + rope;
  if (nope_only && rope != 0)
    return absl::InvalidArgumentError(absl::StrCat(p, ": qk_rope_head_dim ", rope, " on a layer without rope"));
  if (!nope_only && cfg.rope.rotary_dim != rope)
    return absl::InvalidArgumentError(absl::StrCat(p, ": rotary dimensions ", cfg.rope.rotary_dim,
                                                   " differ from qk_rope_head_dim ", rope));
  a->q_low_rank_ = cfg.q_lora_rank > 0;
  if (a->q_low_rank_) {
    EXL3_ASSIGN_OR_RETURN(a->q_a_, CudaLinear::Load(src, p + "q_a_proj", H, cfg.q_lora_rank));
    EXL3_ASSIGN_OR_RETURN(a->q_a_norm_, UploadVector(src, p + "q_a_layernorm.weight", cfg.q_lora_rank));
    EXL3_ASSIGN_OR_RETURN(a->q_b_, CudaLinear::Load(src, p + "q_b_proj", cfg.q_lora_rank, NH * qd));
  } else {
    EXL3_ASSIGN_OR_RETURN(a->q_, CudaLinear::Load(src, p + "q_proj", H, NH * qd));
  }
  EXL3_ASSIGN_OR_RETURN(a->kv_a_, CudaLinear::Load(src, p + "kv_a_proj_with_mqa", H, R + rope));
  EXL3_ASSIGN_OR_RETURN(a->kv_a_norm_, UploadVector(src, p + "kv_a_layernorm.weight", R));
  {
    // Decoded once here, exactly as the CPU engine decodes it (engine/cpu/attention/mla_attention.cc).
    EXL3_ASSIGN_OR_RETURN(Linear kv_b, Linear::Load(src, p + "kv_b_proj", R, NH * (nope + vd)));
    if (kv_b.has_bias()) return absl::UnimplementedError(p + "kv_b_proj has a bias (not absorbed)");
    EXL3_RETURN_IF_ERROR(a->kv_b_.Upload(kv_b.DenseWeight()));
  }
  EXL3_ASSIGN_OR_RETURN(a->o_, CudaLinear::Load(src, p + "o_proj", NH * vd, H));

  if (cfg.attention == AttentionKind::kDsa) {
    const std::string ip = p + "indexer.";
    if (!cfg.HasOwnIndexer(layer)) {
      bool earlier = false;
      for (int l = 0; l < layer; ++l) earlier |= cfg.HasOwnIndexer(l);
      if (!earlier)
        return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " shares the top-k selection of an earlier "
                                                       "layer, and no earlier layer runs an indexer"));
      return a;
    }
    if (!a->q_low_rank_)
      return absl::InvalidArgumentError(absl::StrCat(ip, "wq_b: the indexer reads q_a_proj's output (q_lora_rank 0)"));
    const IndexerConfig& ix = cfg.indexer;
    if (ix.head_dim < rope)
      return absl::InvalidArgumentError(absl::StrCat(ip, ": index_head_dim ", ix.head_dim, " below the ", rope,
                                                     " rotated dimensions"));
    Indexer in;
    EXL3_ASSIGN_OR_RETURN(in.wq_b, CudaLinear::Load(src, ip + "wq_b", cfg.q_lora_rank, ix.num_heads * ix.head_dim));
    EXL3_ASSIGN_OR_RETURN(in.wk, CudaLinear::Load(src, ip + "wk", H, ix.head_dim));
    EXL3_ASSIGN_OR_RETURN(in.weights_proj, CudaLinear::Load(src, ip + "weights_proj", H, ix.num_heads));
    EXL3_ASSIGN_OR_RETURN(in.k_norm_weight, UploadVector(src, ip + "k_norm.weight", ix.head_dim));
    EXL3_ASSIGN_OR_RETURN(in.k_norm_bias, UploadVector(src, ip + "k_norm.bias", ix.head_dim));
    a->indexer_ = std::move(in);
  }
  return a;
}

int64_t CudaLatentAttention::weight_bytes() const {
  int64_t b = static_cast<int64_t>(kv_b_.size() * sizeof(float));
  for (const CudaLinear* l : linears()) b += l->weight_bytes();
  return b;
}

std::vector<const CudaLinear*> CudaLatentAttention::linears() const {
  std::vector<const CudaLinear*> v;
  if (q_low_rank_) {
    v = {&q_a_, &q_b_};
  } else {
    v = {&q_};
  }
  v.push_back(&kv_a_);
  v.push_back(&o_);
  if (indexer_) {
    v.push_back(&indexer_->wq_b);
    v.push_back(&indexer_->wk);
    v.push_back(&indexer_->weights_proj);
  }
  return v;
}

absl::Status CudaLatentAttention::Forward(const float* x, int T, const LatentStep& step, KvHalf* cache_layer,
                                          LatentWorkspace& ws, const CudaLinearContext& ctx, float* out) const {
  EXL3_RETURN_IF_ERROR(ProjectAndCache(x, T, step, cache_layer, ws, ctx));
  if (indexer_) EXL3_RETURN_IF_ERROR(Select(x, T, step, cache_layer, ws, ctx));
  LatentSelection selection;
  const bool sparse = cfg_.attention == AttentionKind::kDsa;
  if (sparse) {
    const LatentWorkspace::Rows w = ws.RowsFrom(cfg_, step.first_row, step.splits);
    selection.positions = w.selected;
    selection.count = w.selected_count;
    selection.stride = cfg_.indexer.topk;
  }
  return AttendAndProject(T, step, cache_layer, sparse ? &selection : nullptr, ws, ctx, out);
}

absl::Status CudaLatentAttention::ProjectAndCache(const float* x, int T, const LatentStep& step, KvHalf* cache_layer,
                                                  LatentWorkspace& ws, const CudaLinearContext& ctx) const {
  const int NH = cfg_.num_heads, R = cfg_.kv_lora_rank, nope = cfg_.qk_nope_head_dim;
  const int rope = cfg_.qk_rope_head_dim, qd = nope + rope, W = R + rope;
  const int width = cfg_.KvWidth(layer_);
  const bool interleaved = cfg_.rope.layout == RopeLayout::kInterleaved;
  const float eps = cfg_.latent_norm_eps;
  StreamHandle stream = ctx.stream;
  const LatentWorkspace::Rows w = ws.RowsFrom(cfg_, step.first_row, step.splits);
  // Queries, the latent and the rope key.
  if (q_low_rank_) {
    EXL3_RETURN_IF_ERROR(q_a_.Forward(x, T, w.q_resid, ctx));
    EXL3_RETURN_IF_ERROR(RmsNorm(w.q_resid, q_a_norm_.get(), T, cfg_.q_lora_rank, eps, w.q_resid, stream));
    EXL3_RETURN_IF_ERROR(q_b_.Forward(w.q_resid, T, w.q, ctx));
  } else {
    EXL3_RETURN_IF_ERROR(q_.Forward(x, T, w.q, ctx));
  }
  EXL3_RETURN_IF_ERROR(kv_a_.Forward(x, T, w.ckv, ctx));
  if (rope > 0) {
    EXL3_RETURN_IF_ERROR(ApplyRope(w.q + nope, T, NH, NH * qd, qd, rope, interleaved, step.cos, step.sin, stream));
    EXL3_RETURN_IF_ERROR(ApplyRope(w.ckv + R, T, 1, W, W, rope, interleaved, step.cos, step.sin, stream));
  }
  return WriteLatentToCache(w.ckv, kv_a_norm_.get(), T, R, rope, eps, step.slot, cache_layer, width, stream);
}

absl::Status CudaLatentAttention::AttendAndProject(int T, const LatentStep& step, const KvHalf* cache_layer,
                                                   const LatentSelection* selection, LatentWorkspace& ws,
                                                   const CudaLinearContext& ctx, float* out) const {
  const int NH = cfg_.num_heads, R = cfg_.kv_lora_rank, nope = cfg_.qk_nope_head_dim;
  const int rope = cfg_.qk_rope_head_dim, vd = cfg_.v_head_dim, qd = nope + rope;
  const int width = cfg_.KvWidth(layer_);
  StreamHandle stream = ctx.stream;
  const LatentWorkspace::Rows w = ws.RowsFrom(cfg_, step.first_row, step.splits);
  // q_latent[t, h] = q_nope[t, h] · W_uk(h): per head, row-major [T, nope] · [nope, R] (cuBLAS is
  // column-major: C^T = B^T · A^T, each operand read in place at its strides).
  cublasHandle_t handle = static_cast<cublasHandle_t>(ctx.cublas);
  const float one = 1.0f, zero = 0.0f;
  const long long head_rows = static_cast<long long>(nope + vd) * R;  // kv_b_ floats per head
  EXL3_RETURN_IF_ERROR(CublasStatus(
      cublasSgemmStridedBatched(handle, CUBLAS_OP_N, CUBLAS_OP_N, R, T, nope, &one, kv_b_.get(), R, head_rows,
                                w.q, NH * qd, qd, &zero, w.q_latent, NH * R, R, NH),
      "latent attention: absorbing kv_b_proj into the queries"));

  LatentAttentionShape shape;
  shape.num_heads = NH;
  shape.latent_dim = R;
  shape.rope_dim = rope;
  shape.q_stride = qd;
  shape.rope_offset = nope;
  shape.cache_width = width;
  shape.scale = cfg_.attention_scale;
  const LatentKernel kernel = step.kernel == LatentKernel::kTensorCores && LatentTensorCoresSupport(shape)
                                  ? LatentKernel::kTensorCores
                                  : LatentKernel::kCudaCores;
  EXL3_RETURN_IF_ERROR(LatentAttention(w.q_latent, w.q, cache_layer, step.tokens, selection, T, shape, step.splits,
                                       step.split_positions, w.scratch, w.o_latent, stream, kernel));

  // attn[t, h] = W_uv(h) · o_latent[t, h]: per head, row-major [T, R] · W_uv(h)ᵀ [R, vd].
  EXL3_RETURN_IF_ERROR(CublasStatus(
      cublasSgemmStridedBatched(handle, CUBLAS_OP_T, CUBLAS_OP_N, vd, T, R, &one,
                                kv_b_.get() + static_cast<size_t>(nope) * R, R, head_rows, w.o_latent, NH * R, R,
                                &zero, w.attn, NH * vd, vd, NH),
      "latent attention: kv_b_proj's value part on the latent output"));
  return o_.Forward(w.attn, T, out, ctx);
}

absl::Status CudaLatentAttention::Select(const float* x, int T, const LatentStep& step, KvHalf* cache_layer,
                                         LatentWorkspace& ws, const CudaLinearContext& ctx) const {
  const Indexer& in = *indexer_;
  const IndexerConfig& ix = cfg_.indexer;
  const int NI = ix.num_heads, DI = ix.head_dim, rope = cfg_.qk_rope_head_dim;
  const bool interleaved = cfg_.rope.layout == RopeLayout::kInterleaved;
  StreamHandle stream = ctx.stream;
  const LatentWorkspace::Rows w = ws.RowsFrom(cfg_, step.first_row, step.splits);
  EXL3_RETURN_IF_ERROR(in.wq_b.Forward(w.q_resid, T, w.index_q, ctx));
  EXL3_RETURN_IF_ERROR(in.wk.Forward(x, T, w.index_k, ctx));
  EXL3_RETURN_IF_ERROR(in.weights_proj.Forward(x, T, w.index_w, ctx));
  EXL3_RETURN_IF_ERROR(LayerNormRows(w.index_k, in.k_norm_weight.get(), in.k_norm_bias.get(), T, DI,
                                     kIndexerNormEps, stream));
  EXL3_RETURN_IF_ERROR(ApplyRope(w.index_k, T, 1, DI, DI, rope, interleaved, step.cos, step.sin, stream));
  EXL3_RETURN_IF_ERROR(ApplyRope(w.index_q, T, NI, NI * DI, DI, rope, interleaved, step.cos, step.sin, stream));
  const int width = cfg_.KvWidth(layer_), key_offset = cfg_.kv_lora_rank + rope;
  EXL3_RETURN_IF_ERROR(WriteRowsToCache(w.index_k, T, DI, step.slot, cache_layer, width, key_offset, stream));

  const float head_weight = static_cast<float>(1.0 / std::sqrt(static_cast<double>(NI)));
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(DI)));
  IndexerShape shape{NI, DI, width, key_offset};
  const bool tensor_cores = step.kernel == LatentKernel::kTensorCores && IndexerTensorCoresSupport(shape);
  // The score rows hold a group of this call's tokens at a time (consumed by the group's top-k).
  for (int t0 = 0; t0 < T; t0 += ws.score_rows) {
    const int n = std::min(ws.score_rows, T - t0);
    // Enough blocks to fill the GPU a few times over; each loops over its token's positions.
    const int tiles = (ws.score_length + 31) / 32;
    const int blocks = std::max(1, std::min(tiles, 4 * step.sm_count / n));
    EXL3_RETURN_IF_ERROR(IndexerScores(w.index_q, w.index_w, head_weight, scale, cache_layer, step.tokens, shape, t0, n,
                                       blocks, ws.scores.get(), ws.score_length, stream, tensor_cores));
    EXL3_RETURN_IF_ERROR(IndexerTopk(ws.scores.get(), ws.score_length, step.tokens.position, t0, n, ix.topk,
                                     w.selected, w.selected_count, stream));
  }
  return absl::OkStatus();
}

}  // namespace exl3::engine::cuda
