#include "engine/cuda/dsv4_attention.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/cuda/cublas_status.h"
#include "engine/cuda/dsa_indexer_kernels.h"
#include "engine/cuda/engine_kernels.h"
#include "engine/cuda/weight_upload.h"
#include "engine/cpu/attention/dsv4_grouped_wo_a.h"
#include "engine/cpu/linear.h"
#include "kernels/cuda/cuda_status.h"

namespace exl3::engine::cuda {
namespace {

// Floats of index scores held at once (128 MiB): a long prefill scores its tokens in groups.
constexpr int64_t kScoreBudgetFloats = int64_t{32} << 20;
constexpr int kMinScoreRows = 64;
constexpr int kMaxScoreRows = 32768;  // the score kernel's grid

}  // namespace

absl::Status Dsv4Workspace::Reserve(const ModelConfig& cfg, int T, int max_context) {
  const Dsv4Config& v = *cfg.dsv4;
  const size_t t = static_cast<size_t>(std::max(T, 1)), NH = cfg.num_heads, D = v.head_dim;
  const size_t DI = std::max(v.index_head_dim, 1), NI = std::max(v.index_heads, 1);
  score_length = std::max(max_context / std::max(v.csa_compress_rate, 1) + 1, 1);
  const int64_t rows =
      std::min<int64_t>(kMaxScoreRows, std::max<int64_t>(kMinScoreRows, kScoreBudgetFloats / score_length));
  score_rows = static_cast<int>(std::min<int64_t>(rows, static_cast<int64_t>(t)));
  struct Need {
    DeviceArray<float>* a;
    size_t n;
  };
  const Need needs[] = {{&q_resid, t * v.q_lora_rank},
                        {&q, t * NH * D},
                        {&kv, t * D},
                        {&attn, t * NH * D},
                        {&low_rank, t * v.o_groups * v.o_lora_rank},
                        {&comp_kv, t * 2 * D},
                        {&comp_gate, t * 2 * D},
                        {&ix_kv, t * 2 * DI},
                        {&ix_gate, t * 2 * DI},
                        {&ix_q, t * NI * DI},
                        {&ix_w, t * NI},
                        {&scores, static_cast<size_t>(score_rows) * score_length}};
  for (const Need& n : needs) EXL3_RETURN_IF_ERROR(n.a->Reserve(n.n));
  EXL3_RETURN_IF_ERROR(selected.Reserve(t * std::max(v.index_topk, 1)));
  return selected_count.Reserve(t);
}

Dsv4StepFacts::Dsv4StepFacts(const ModelConfig& cfg)
    : v4_(*cfg.dsv4),
      main_(cfg.dsv4->main_rope, cfg.max_position_embeddings),
      compress_(cfg.dsv4->compress_rope, cfg.max_position_embeddings) {}

absl::Status Dsv4StepFacts::Init() {
  EXL3_RETURN_IF_ERROR(error_.Upload(std::vector<int32_t>{0}));
  return absl::OkStatus();
}

absl::Status Dsv4StepFacts::Prepare(const StepTokens& tokens, const AttentionTokens& base, int sm_count,
                                    StreamHandle stream, Dsv4Step* step) {
  const int T = tokens.num_tokens, half = v4_.rope_dim / 2;
  const int csa = std::max(v4_.csa_compress_rate, 1), hca = std::max(v4_.hca_compress_rate, 1);
  std::vector<int> chunk_start;
  for (int t = 0; t < T; ++t)
    if (t == 0 || tokens.chunk_of[t] != tokens.chunk_of[t - 1]) chunk_start.push_back(t);
  chunk_start.push_back(T);
  const int C = static_cast<int>(chunk_start.size()) - 1;
  // Layout: chunk_start [C + 1] | csa_last_entry [T] | 8 angle tables [T, half] (float bits).
  const size_t ints = static_cast<size_t>(C + 1) + T, table = static_cast<size_t>(T) * half;
  host_.assign(ints + 8 * table, 0);
  std::copy(chunk_start.begin(), chunk_start.end(), host_.begin());
  int32_t* last_entry = host_.data() + C + 1;
  float* angles = reinterpret_cast<float*>(host_.data() + ints);
  RopeAngles a;
  auto put = [&](int which, int t) {
    std::copy(a.cos.begin(), a.cos.end(), angles + (2 * which) * table + static_cast<size_t>(t) * half);
    std::copy(a.sin.begin(), a.sin.end(), angles + (2 * which + 1) * table + static_cast<size_t>(t) * half);
  };
  for (int t = 0; t < T; ++t) {
    const int pos = tokens.positions[t], len = tokens.seq_len_after[t];
    last_entry[t] = (pos + 1) / csa - 1;
    main_.Angles(pos, len, &a);
    put(0, t);
    compress_.Angles(pos, len, &a);
    put(1, t);
    compress_.Angles(pos / csa * csa, pos / csa * csa + 1, &a);
    put(2, t);
    compress_.Angles(pos / hca * hca, pos / hca * hca + 1, &a);
    put(3, t);
  }
  EXL3_RETURN_IF_ERROR(device_.Reserve(host_.size()));
  EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(device_.get(), host_.data(), host_.size() * sizeof(int32_t),
                                            cudaMemcpyHostToDevice, static_cast<cudaStream_t>(stream)));
  const int32_t* d = device_.get();
  const float* f = reinterpret_cast<const float*>(d + ints);
  step->tokens = base;
  step->chunk_start = d;
  step->num_chunks = C;
  step->csa_last_entry = d + C + 1;
  step->main_cos = f;
  step->main_sin = f + table;
  step->compress_cos = f + 2 * table;
  step->compress_sin = f + 3 * table;
  step->csa_entry_cos = f + 4 * table;
  step->csa_entry_sin = f + 5 * table;
  step->hca_entry_cos = f + 6 * table;
  step->hca_entry_sin = f + 7 * table;
  step->error = error_.get();
  step->chunk_keeping = nullptr;  // the kind's kept states bind theirs after this, with speculative decoding
  step->sm_count = sm_count;
  return absl::OkStatus();
}

absl::Status Dsv4StepFacts::TakeError(StreamHandle stream) {
  int32_t code = 0;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  EXL3_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&code, error_.get(), sizeof(code), cudaMemcpyDeviceToHost, s));
  EXL3_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  if (code == 0) return absl::OkStatus();
  EXL3_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(error_.get(), 0, sizeof(code), s));
  return absl::InternalError(
      code == 1 ? "DeepSeek-V4 compressors: a chunk starts a cache block whose predecessor does not hold all its "
                  "folded positions: its compressor state cannot be continued"
                : "DeepSeek-V4 compressors: a chunk's position follows fewer folded positions of its cache block");
}

CudaDsv4Attention::CudaDsv4Attention(const ModelConfig& cfg, int layer)
    : cfg_(cfg),
      v4_(*cfg.dsv4),
      layer_(layer),
      type_(cfg.dsv4->layer_types[layer]),
      rate_(cfg.dsv4->CompressRate(layer)) {}

absl::StatusOr<std::unique_ptr<CudaDsv4Attention>> CudaDsv4Attention::Load(const ModelConfig& cfg,
                                                                           const TensorSource& src, int layer) {
  if (cfg.attention != AttentionKind::kDsv4 || cfg.dsv4 == nullptr)
    return absl::InvalidArgumentError("CudaDsv4Attention: not a DeepSeek-V4 model");
  std::unique_ptr<CudaDsv4Attention> a(new CudaDsv4Attention(cfg, layer));
  const Dsv4Config& v = *cfg.dsv4;
  const int H = cfg.hidden_size, NH = cfg.num_heads, D = v.head_dim, G = v.o_groups, R = v.o_lora_rank;
  const std::string p = absl::StrCat("model.layers.", layer, ".attn.");
  EXL3_ASSIGN_OR_RETURN(a->wq_a_, CudaLinear::Load(src, p + "wq_a", H, v.q_lora_rank));
  EXL3_ASSIGN_OR_RETURN(a->q_norm_, UploadVector(src, p + "q_norm.weight", v.q_lora_rank));
  EXL3_ASSIGN_OR_RETURN(a->wq_b_, CudaLinear::Load(src, p + "wq_b", v.q_lora_rank, NH * D));
  EXL3_ASSIGN_OR_RETURN(a->wkv_, CudaLinear::Load(src, p + "wkv", H, D));
  EXL3_ASSIGN_OR_RETURN(a->kv_norm_, UploadVector(src, p + "norm.weight", D));
  EXL3_ASSIGN_OR_RETURN(a->sinks_, UploadVector(src, p + "attn_sink", NH));
  EXL3_ASSIGN_OR_RETURN(a->wo_b_, CudaLinear::Load(src, p + "wo_b", G * R, H));
  {
    // wo_a [G * R, NH * D / G]: group g's rows g R .. (g + 1) R; decoded here as the CPU does.
    EXL3_ASSIGN_OR_RETURN(const std::vector<float> wo_a, LoadGroupedWoA(src, p + "wo_a", G, R, NH * D / G));
    EXL3_RETURN_IF_ERROR(a->wo_a_.Upload(wo_a));
  }
  if (a->type_ == Dsv4LayerType::kSlidingWindow) {
    if (src.Has(p + "compressor.ape"))
      return absl::InvalidArgumentError(absl::StrCat(p, "compressor.*: layer ", layer, " has compressor weights but "
                                                     "layer_types makes it sliding_attention"));
    return a;
  }
  auto load_compressor = [&](const std::string& q, int dim, int width) -> absl::StatusOr<Compressor> {
    Compressor c;
    c.dim = dim;
    c.width = width;
    EXL3_ASSIGN_OR_RETURN(c.wkv, CudaLinear::Load(src, q + "wkv", H, width));
    EXL3_ASSIGN_OR_RETURN(c.wgate, CudaLinear::Load(src, q + "wgate", H, width));
    EXL3_ASSIGN_OR_RETURN(c.ape, UploadMatrix(src, q + "ape", a->rate_, width));
    EXL3_ASSIGN_OR_RETURN(c.norm, UploadVector(src, q + "norm.weight", dim));
    return c;
  };
  const bool csa = a->type_ == Dsv4LayerType::kCompressedSparse;
  EXL3_ASSIGN_OR_RETURN(a->compressor_, load_compressor(p + "compressor.", D, (csa ? 2 : 1) * D));
  if (csa) {
    Indexer ix;
    EXL3_ASSIGN_OR_RETURN(ix.wq_b,
                          CudaLinear::Load(src, p + "indexer.wq_b", v.q_lora_rank, v.index_heads * v.index_head_dim));
    EXL3_ASSIGN_OR_RETURN(ix.weights_proj, CudaLinear::Load(src, p + "indexer.weights_proj", H, v.index_heads));
    EXL3_ASSIGN_OR_RETURN(ix.compressor,
                          load_compressor(p + "indexer.compressor.", v.index_head_dim, 2 * v.index_head_dim));
    a->indexer_ = std::move(ix);
  }
  return a;
}

std::vector<const CudaLinear*> CudaDsv4Attention::linears() const {
  std::vector<const CudaLinear*> v = {&wq_a_, &wq_b_, &wkv_, &wo_b_};
  if (compressor_) {
    v.push_back(&compressor_->wkv);
    v.push_back(&compressor_->wgate);
  }
  if (indexer_) {
    v.push_back(&indexer_->wq_b);
    v.push_back(&indexer_->weights_proj);
    v.push_back(&indexer_->compressor.wkv);
    v.push_back(&indexer_->compressor.wgate);
  }
  return v;
}

int64_t CudaDsv4Attention::weight_bytes() const {
  int64_t b = static_cast<int64_t>(wo_a_.size() * sizeof(float));
  for (const CudaLinear* l : linears()) b += l->weight_bytes();
  return b;
}

absl::Status CudaDsv4Attention::Forward(const float* x, int T, const Dsv4Step& step, const Dsv4CacheView& cache,
                                        Dsv4Workspace& ws, const CudaLinearContext& ctx, float* out) const {
  const int NH = cfg_.num_heads, D = v4_.head_dim, RD = v4_.rope_dim;
  const float eps = cfg_.rms_norm_eps;
  StreamHandle stream = ctx.stream;
  const bool sliding = type_ == Dsv4LayerType::kSlidingWindow;
  const float* cos = sliding ? step.main_cos : step.compress_cos;
  const float* sin = sliding ? step.main_sin : step.compress_sin;
  // Queries and the shared key/value (into the cache).
  EXL3_RETURN_IF_ERROR(wq_a_.Forward(x, T, ws.q_resid.get(), ctx));
  EXL3_RETURN_IF_ERROR(RmsNorm(ws.q_resid.get(), q_norm_.get(), T, v4_.q_lora_rank, eps, ws.q_resid.get(), stream));
  EXL3_RETURN_IF_ERROR(wq_b_.Forward(ws.q_resid.get(), T, ws.q.get(), ctx));
  EXL3_RETURN_IF_ERROR(Dsv4RotateTail(ws.q.get(), T, NH, D, RD, cos, sin, 1.0f, /*normalize=*/true, eps, stream));
  EXL3_RETURN_IF_ERROR(wkv_.Forward(x, T, ws.kv.get(), ctx));
  EXL3_RETURN_IF_ERROR(RmsNorm(ws.kv.get(), kv_norm_.get(), T, D, eps, ws.kv.get(), stream));
  EXL3_RETURN_IF_ERROR(Dsv4RotateTail(ws.kv.get(), T, 1, D, RD, cos, sin, 1.0f, /*normalize=*/false, eps, stream));
  EXL3_RETURN_IF_ERROR(Dsv4WriteSlots(ws.kv.get(), T, step.tokens, cache, stream));

  Dsv4Entries entries;
  if (compressor_) {
    const Dsv4CacheLayout layout = CacheLayoutFor(v4_, type_, cache.block_size);
    const bool csa = indexer_.has_value();
    // Every token's projections, then the fold of each chunk in position order.
    EXL3_RETURN_IF_ERROR(compressor_->wkv.Forward(x, T, ws.comp_kv.get(), ctx));
    EXL3_RETURN_IF_ERROR(compressor_->wgate.Forward(x, T, ws.comp_gate.get(), ctx));
    Dsv4FoldArgs fold;
    fold.rate = rate_;
    fold.folded = layout.folded;
    fold.accumulators_end = layout.accumulators_end;
    fold.rope_dim = RD;
    fold.eps = eps;
    auto args = [](const Compressor& c, const Dsv4CompressorCache& at, const float* kv, const float* gate) {
      Dsv4CompressorArgs k;
      k.dim = c.dim;
      k.overlapping = at.overlapping;
      k.current = at.current;
      k.next = at.next;
      k.entries = at.entries;
      k.kv = kv;
      k.gate = gate;
      k.ape = c.ape.get();
      k.norm = c.norm.get();
      return k;
    };
    fold.compressor = args(*compressor_, layout.compressor, ws.comp_kv.get(), ws.comp_gate.get());
    fold.kept = cache.kept;  // a verify chunk's states, and the restore after rejected drafts
    fold.chunk_keeping = step.chunk_keeping;
    if (csa) {
      const Compressor& k = indexer_->compressor;
      EXL3_RETURN_IF_ERROR(k.wkv.Forward(x, T, ws.ix_kv.get(), ctx));
      EXL3_RETURN_IF_ERROR(k.wgate.Forward(x, T, ws.ix_gate.get(), ctx));
      fold.indexer = args(k, layout.indexer, ws.ix_kv.get(), ws.ix_gate.get());
    }
    EXL3_RETURN_IF_ERROR(Dsv4Fold(fold, cache, step.tokens, step.chunk_start, step.num_chunks,
                                  csa ? step.csa_entry_cos : step.hca_entry_cos,
                                  csa ? step.csa_entry_sin : step.hca_entry_sin, step.error, stream));
    entries.rate = rate_;
    entries.offset = layout.compressor.entries;
    if (csa) {
      // The indexer: its queries at the token's position, its head weights, each token's top-k
      // of the entries it sees (all while it sees no more).
      const int NI = v4_.index_heads, DI = v4_.index_head_dim, topk = v4_.index_topk;
      EXL3_RETURN_IF_ERROR(indexer_->wq_b.Forward(ws.q_resid.get(), T, ws.ix_q.get(), ctx));
      EXL3_RETURN_IF_ERROR(Dsv4RotateTail(ws.ix_q.get(), T, NI, DI, RD, step.compress_cos, step.compress_sin, 1.0f,
                                          /*normalize=*/false, eps, stream));
      EXL3_RETURN_IF_ERROR(indexer_->weights_proj.Forward(x, T, ws.ix_w.get(), ctx));
      const float head_weight = static_cast<float>(1.0 / std::sqrt(static_cast<double>(NI)));
      const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(DI)));
      const Dsv4IndexShape shape{NI, DI, rate_, layout.indexer.entries, topk};
      for (int t0 = 0; t0 < T; t0 += ws.score_rows) {
        const int n = std::min(ws.score_rows, T - t0);
        const int blocks = std::max(1, std::min((ws.score_length + 31) / 32, 4 * step.sm_count / n));
        EXL3_RETURN_IF_ERROR(Dsv4IndexScores(ws.ix_q.get(), ws.ix_w.get(), head_weight, scale, cache, step.tokens,
                                             step.csa_last_entry, shape, t0, n, blocks, ws.scores.get(),
                                             ws.score_length, stream));
        EXL3_RETURN_IF_ERROR(IndexerTopk(ws.scores.get(), ws.score_length, step.csa_last_entry, t0, n, topk,
                                         ws.selected.get(), ws.selected_count.get(), stream));
      }
      entries.selected = ws.selected.get();
      entries.count = ws.selected_count.get();
      entries.stride = topk;
    }
  }
  EXL3_RETURN_IF_ERROR(Dsv4Attend(ws.q.get(), sinks_.get(), cache, step.tokens, entries, T, NH, D, RD,
                                  cfg_.attention_scale, cos, sin, ws.attn.get(), stream));

  // The grouped output projection: low_rank[t, g R + r] = wo_a[g R + r] · attn[t, g's slice], the
  // groups as one batched product (cuBLAS is column-major: C^T = op(A) · B^T in place).
  const int G = v4_.o_groups, R = v4_.o_lora_rank, in_per_group = NH * D / G;
  const float one = 1.0f, zero = 0.0f;
  EXL3_RETURN_IF_ERROR(CublasStatus(
      cublasSgemmStridedBatched(static_cast<cublasHandle_t>(ctx.cublas), CUBLAS_OP_T, CUBLAS_OP_N, R, T,
                                in_per_group, &one, wo_a_.get(), in_per_group,
                                static_cast<long long>(R) * in_per_group, ws.attn.get(), NH * D, in_per_group, &zero,
                                ws.low_rank.get(), G * R, R, G),
      "DeepSeek-V4 attention: the grouped wo_a"));
  return wo_b_.Forward(ws.low_rank.get(), T, out, ctx);
}

}  // namespace exl3::engine::cuda
